"""Skinny GEMM for decode-sized linear layers: y = x @ w.T (+ bias), x [M, K] with M up to
MAX_M, w [N, K] row-major (nn.Linear's layout), fp32 accumulation, y in x's dtype (or
float32, for logits). `linear` is the op the model calls: this kernel where it measured faster
than cuBLAS on the H100 (`decode_config`), cuBLAS elsewhere.

Memory bound: the weight is read exactly once. Grid (column tiles, k_splits): a program owns
BLOCK_N output columns for all M rows and streams w[BLOCK_N, BLOCK_K] tiles along its share of
K; x (a few KiB) is re-read from L2 by every program. Rows past N (and past M) repeat the last
row, so no load is masked except at a ragged end of K, and the tail is dropped at the store.
Two ways to multiply, picked by the config:
- CUDA cores (`use_dot=False`): fp32 products summed into a [BLOCK_N, BLOCK_M, BLOCK_K]
  accumulator and reduced along K once at the end (M = 1 runs a plain [BLOCK_N, BLOCK_K]).
- tensor cores (`use_dot=True`): tl.dot(w tile, x tile^T) with M padded to at least 16 (the
  smallest dot a GPU takes), so M = 1 and M = 16 cost the same.
With k_splits > 1 each split writes its partial sums into a float32 workspace
[k_splits, M, N] with plain stores (every element has one writer: no zero-fill and no atomics,
so repeated calls and CUDA-graph replays are deterministic), and a second launch sums the
splits, adds the bias and rounds to y.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from loraplex.kernels._common import (
    FLOAT_DTYPES,
    cdiv,
    check_launchable,
    check_tensor,
    next_pow2,
    num_sms,
    upcast_loads,
)

MAX_M = 64
"""Largest number of rows (tokens) the kernel takes; larger batches belong to cuBLAS."""
MAX_FMA_M = 4
"""default_config multiplies on the CUDA cores up to this many rows, on the tensor cores above."""
MIN_DOT = 16
"""Smallest dot dimension a GPU compiles: the dot path's BLOCK_N, BLOCK_K and padded M."""
MIN_SPLIT_K = 1024
"""default_config never splits K into chunks shorter than this."""
REDUCE_BLOCK = 512
"""Columns per program of the split-sum launch."""


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    """Output columns (weight rows) per program; a power of 2."""
    block_k: int
    """Input features per loop step; a power of 2."""
    split_k: int = 1
    """Programs sharing a column tile's K (at most; fewer when K is short). Above 1 the
    partial sums go through a float32 workspace and a second launch."""
    num_warps: int = 4
    num_stages: int = 4
    """Loop steps in flight (async copies through shared memory)."""
    use_dot: bool = False
    """Multiply on the tensor cores (tl.dot, M padded to 16) instead of the CUDA cores."""


@triton.jit
def _fma_partial(x_ptrs, w_ptrs, k_lo, k_hi, K,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """CUDA cores: sum over [k_lo, k_hi) of x[m, k] * w[n, k] -> float32 [BLOCK_N, BLOCK_M].
    x_ptrs [BLOCK_M, BLOCK_K] (or [BLOCK_K] when BLOCK_M == 1), w_ptrs [BLOCK_N, BLOCK_K]: the
    tile at k = 0."""
    rk = tl.arange(0, BLOCK_K)
    if BLOCK_M == 1:
        part = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    else:
        part = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_K], tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs + k0)
            x = tl.load(x_ptrs + k0)
        else:
            k_mask = (k0 + rk) < K
            w = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0)
            if BLOCK_M == 1:
                x = tl.load(x_ptrs + k0, mask=k_mask, other=0.0)
            else:
                x = tl.load(x_ptrs + k0, mask=k_mask[None, :], other=0.0)
        w = w.to(tl.float32)
        x = x.to(tl.float32)
        if BLOCK_M == 1:
            part += w * x[None, :]
        else:
            part += w[:, None, :] * x[None, :, :]
    if BLOCK_M == 1:
        acc = tl.sum(part, axis=1)[:, None]
    else:
        acc = tl.sum(part, axis=2)
    return acc


@triton.jit
def _dot_partial(x_ptrs, w_ptrs, k_lo, k_hi, K,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                 NUM_STAGES: tl.constexpr):
    """Tensor cores: as _fma_partial, by tl.dot(w [BLOCK_N, BLOCK_K], x^T [BLOCK_K, BLOCK_M])
    with BLOCK_M >= 16 (padded rows repeat a real row; their columns are never stored)."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs + k0)
            x = tl.load(x_ptrs + k0)
        else:
            k_mask = (k0 + rk) < K
            w = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0)
            x = tl.load(x_ptrs + k0, mask=k_mask[None, :], other=0.0)
        if UPCAST:
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_om, stride_osplit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    IS_PARTIAL: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """out [M, N] = x @ w^T (+ bias) in out's dtype; with IS_PARTIAL, out is the float32
    workspace [k_splits, M, N] and program (n, s) stores split s's partial sums, no bias."""
    n0 = tl.program_id(0) * BLOCK_N
    split = tl.program_id(1)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    rn = tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    # Rows past the end repeat the last one: every load stays in bounds without a mask.
    w_rows = tl.minimum(rn, N - 1 - n0)  # [BLOCK_N], relative to row n0
    x_rows = tl.minimum(rm, M - 1)  # [BLOCK_M]
    w_ptrs = w_ptr + n0.to(tl.int64) * stride_wn + w_rows[:, None] * stride_wn + rk[None, :]
    if BLOCK_M == 1:
        x_ptrs = x_ptr + rk  # [BLOCK_K]
    else:
        x_ptrs = x_ptr + x_rows[:, None] * stride_xm + rk[None, :]  # [BLOCK_M, BLOCK_K]
    if USE_DOT:
        acc = _dot_partial(x_ptrs, w_ptrs, k_lo, k_hi, K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                           UPCAST, INPUT_PRECISION, NUM_STAGES)
    else:
        acc = _fma_partial(x_ptrs, w_ptrs, k_lo, k_hi, K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                           NUM_STAGES)
    # acc [BLOCK_N, BLOCK_M] = out[m, n0 + n] for the real rows and columns
    cols = n0 + rn
    mask = (cols < N)[:, None] & (rm < M)[None, :]
    if IS_PARTIAL:
        ptrs = out_ptr + split * stride_osplit + rm[None, :] * stride_om + cols[:, None]
        tl.store(ptrs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
        ptrs = out_ptr + rm[None, :] * stride_om + cols[:, None]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, N, num_splits,
                       stride_psplit, stride_pm, stride_om,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, cols] = sum over splits of part[s, m, cols] (+ bias), rounded to out's dtype.
    Grid (column blocks, M)."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = tl.program_id(1)
    mask = cols < N
    ptrs = part_ptr + m * stride_pm + cols
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(num_splits):
        acc += tl.load(ptrs + s * stride_psplit, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def block_m(m: int, config: SkinnyConfig) -> int:
    """Rows a program holds: M rounded up to a power of 2, and to 16 on the dot path."""
    return max(MIN_DOT, next_pow2(m)) if config.use_dot else next_pow2(m)


def num_k_splits(k: int, config: SkinnyConfig) -> tuple[int, int]:
    """(splits launched, K per split): chunks are whole BLOCK_K steps, so a short K gets fewer
    splits than config.split_k."""
    k_per_split = cdiv(cdiv(max(k, 1), config.split_k), config.block_k) * config.block_k
    return cdiv(max(k, 1), k_per_split), k_per_split


def default_config(m: int, n: int, k: int, device: torch.device) -> SkinnyConfig:
    """A launch config from the shapes alone (no autotuning: it must run under the interpreter
    and inside CUDA-graph capture). Up to MAX_FMA_M rows on the CUDA cores, in tiles of 16
    columns by 256 inputs (128 from 3 rows on, so the fp32 accumulator stays at 64 registers a
    thread); above, tl.dot on M padded to 16 or 32, tiles of 16 columns by 256 inputs. 4 warps,
    3 tiles in flight (num_stages 4). N = 4096 then gives 256 programs; K is split (in powers
    of 2, chunks of at least MIN_SPLIT_K) only while there are fewer programs than SMs. Tiles
    shrink to fit tiny shapes. `loraplex bench skinny-gemm` times candidate_configs against this."""
    use_dot = m > MAX_FMA_M
    block_n = 16
    block_k = 256 if use_dot else min(256, 512 // next_pow2(m))
    block_n = min(block_n, max(MIN_DOT if use_dot else 1, next_pow2(n)))
    block_k = min(block_k, max(MIN_DOT, next_pow2(k)))
    programs = cdiv(n, block_n)
    split_k = 1
    while programs * split_k < num_sms(device) and k // (2 * split_k) >= MIN_SPLIT_K:
        split_k *= 2
    return SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4,
                        num_stages=4, use_dot=use_dot)


# (block_n, block_k, num_warps, num_stages) of each path, swept by `loraplex bench skinny-gemm`.
_FMA_TILES = ((8, 256, 4, 4), (16, 256, 4, 4), (16, 128, 4, 4), (8, 512, 4, 3),
              (16, 512, 4, 3), (16, 512, 8, 3), (32, 256, 8, 3))
_DOT_TILES = ((16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 3), (32, 128, 4, 4),
              (64, 128, 4, 3), (64, 256, 4, 3))
# Largest fp32 accumulator [BLOCK_N, BLOCK_M, BLOCK_K] a warp holds on the CUDA-core path:
# 128 registers a thread.
_MAX_FMA_ACC_PER_WARP = 4096


def candidate_configs(m: int, n: int, k: int) -> list[SkinnyConfig]:
    """The configs worth timing at this shape on the GPU: CUDA-core tiles up to 8 rows (those
    whose accumulator fits in 128 registers a thread), tensor-core tiles from 4 rows; each
    also with K split in 2 and 4 where there are fewer than 512 column tiles and the chunks
    stay at least MIN_SPLIT_K long."""
    tiles = []
    if m <= 8:
        tiles += [(t, False) for t in _FMA_TILES
                  if t[0] * next_pow2(m) * t[1] <= _MAX_FMA_ACC_PER_WARP * t[2]]
    if m >= 4:
        tiles += [(t, True) for t in _DOT_TILES]
    out = []
    for (block_n, block_k, warps, stages), use_dot in tiles:
        for split_k in (1, 2, 4):
            if split_k > 1 and (cdiv(n, block_n) >= 512 or k // split_k < MIN_SPLIT_K):
                continue
            out.append(SkinnyConfig(block_n, block_k, split_k, warps, stages, use_dot))
    return out


def check_config(config: SkinnyConfig) -> None:
    """Raise ValueError unless the config can be launched on the GPU."""
    for name in ("block_n", "block_k"):
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of 2, got {value} in {config}")
    if config.split_k < 1:
        raise ValueError(f"split_k must be at least 1, got {config}")
    if config.use_dot and min(config.block_n, config.block_k) < MIN_DOT:
        raise ValueError(f"the dot path needs block_n and block_k >= {MIN_DOT}, got {config}")


# Measured on the H100 (bench/results/skinny-gemm-h100.json, weights cycled past L2, against
# F.linear at the Llama-3-8B shapes): on the CUDA cores with 8 x 256 tiles the kernel beat
# cuBLAS at every shape for 1 and 2 rows (o_proj 13.2 against 16.4 us, down 40.5 against
# 44.3, lm_head 338 against 376); from 4 rows cuBLAS matched or beat it, except on the
# vocabulary-sized lm_head, where 64 x 256 tensor-core tiles stayed 9% ahead up to 32 rows.
FMA_DECODE = SkinnyConfig(block_n=8, block_k=256, split_k=1, num_warps=4, num_stages=4, use_dot=False)
DOT_DECODE = SkinnyConfig(block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3, use_dot=True)
DOT_DECODE_64 = SkinnyConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3, use_dot=True)
"""33 to 64 rows: DOT_DECODE's x tile would need 256 KiB of shared memory (the H100 has 227)."""
MAX_FMA_DECODE_M = 2
MIN_WIDE_N = 32768
"""An output this wide (a vocabulary) takes the tensor-core tiles up to MAX_M rows."""


def decode_config(m: int, n: int, k: int) -> SkinnyConfig | None:
    """The skinny kernel's config where it measured faster than cuBLAS, else None."""
    if m <= MAX_FMA_DECODE_M:
        return FMA_DECODE
    if n >= MIN_WIDE_N and m <= MAX_M:
        return DOT_DECODE if m <= 32 else DOT_DECODE_64
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K], weight [N, K], bias [N] or None -> x @ weight.T + bias [M, N] in out_dtype
    (default x's dtype): the skinny kernel where decode_config picks it, cuBLAS elsewhere. A
    float32 out_dtype of 16-bit inputs is the float32 accumulator itself, never a rounded
    16-bit result widened (logits near 6 are 0.03 apart in bf16)."""
    m, k = x.shape
    config = decode_config(m, weight.shape[0], k) if x.is_cuda and k == weight.shape[1] else None
    if config is not None and weight.is_contiguous() and x.stride(-1) == 1:
        return skinny_linear(x, weight, bias, config, out_dtype=out_dtype)
    if out_dtype == torch.float32 and x.dtype != torch.float32 and x.is_cuda and bias is None:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)  # cuBLAS, float32 output
    out = F.linear(x, weight, bias)
    return out if out_dtype is None else out.to(out_dtype)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None, out_dtype: torch.dtype | None = None
                  ) -> torch.Tensor:
    """x [M, K] (M <= MAX_M; rows may be strided, each row dense), weight [N, K] contiguous,
    bias [N] or None, all of one dtype -> x @ weight.T + bias [M, N] in out_dtype (default x's
    dtype), accumulated in float32. `config` overrides default_config (for sweeps and tests)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype}")
    m, k = x.shape
    if m > MAX_M:
        raise ValueError(f"skinny_linear takes at most {MAX_M} rows, got x of shape {tuple(x.shape)}")
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,), shape=(None, k), contiguous=True)
    n = weight.shape[0]
    tensors = [x, weight]
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(x.dtype,), shape=(n,), contiguous=True)
        tensors.append(bias)
    device = check_launchable(_skinny_kernel, tensors)
    config = config or default_config(m, n, k, device)
    check_config(config)
    return _launch(x, weight, bias, config, out_dtype or x.dtype)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            config: SkinnyConfig, out_dtype: torch.dtype) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    splits, k_per_split = num_k_splits(k, config)
    common = dict(
        BLOCK_M=block_m(m, config), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        USE_DOT=config.use_dot, EVEN_K=k % config.block_k == 0, HAS_BIAS=bias is not None,
        UPCAST=upcast_loads(x.dtype),
        # float32 operands keep float32's accuracy on the tensor cores (plain tf32 would not)
        INPUT_PRECISION="tf32x3" if x.dtype == torch.float32 else "tf32",
        NUM_STAGES=config.num_stages, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    grid = (cdiv(n, config.block_n), splits)
    bias_arg = bias if bias is not None else out  # never read without HAS_BIAS
    if splits == 1:
        _skinny_kernel[grid](x, weight, bias_arg, out, m, n, k, k_per_split, x.stride(0),
                             weight.stride(0), out.stride(0), 0, IS_PARTIAL=False, **common)
        return out
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    _skinny_kernel[grid](x, weight, bias_arg, part, m, n, k, k_per_split, x.stride(0),
                         weight.stride(0), part.stride(1), part.stride(0), IS_PARTIAL=True,
                         **common)
    _sum_splits_kernel[(cdiv(n, REDUCE_BLOCK), m)](
        part, bias_arg, out, n, splits, part.stride(0), part.stride(1), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK=REDUCE_BLOCK, num_warps=4,
    )
    return out

"""Multi-LoRA shrink (x @ A^T) and expand (y += shrunk @ B^T) over stacked slices (q/k/v, or
gate/up), with a slot per token and no sorting metadata. Two launches per projection group.

Decode batches (up to MAX_GEMV_TOKENS tokens, where every token may carry another adapter) run
per token on the CUDA cores, each adapter read once per token:
- shrink, grid (rank groups, tokens, slices): a program computes BLOCK_R whole rows of one
  token's shrunk vector over the full input dim, so each output element has one writer: no
  zero-fill launch and no atomics. Programs past a slot's rank (and tokens of slot 0) only
  store their zeros.
- expand, grid (column tiles of the whole output, tokens): tiles run across slice boundaries,
  so every program has columns to do; a program walks the slices its tile meets and their
  rank in chunks of 16, loading B chunks [BLOCK_N, 16] whole (16-byte loads, as async copies;
  lanes past the rank are zeroed after the load: in bf16 a chunk row is one 32-byte sector,
  which the rank's columns fetch anyway), and adds into y once.

Larger batches (prefill chunks, whose tokens come in runs of one sequence) take tiles of
BLOCK_M tokens and `tl.dot`; within a tile a program walks the distinct slots of its tokens
("runs"), loading each run's weights once for the whole tile:
- shrink, grid (token tiles, slices, k_splits): the input dim is split for parallelism and the
  partial sums go to a zeroed float32 output with fp32 atomics (plain stores at one split).
- expand, grid (column tiles, token tiles): as the decode expand, with [BLOCK_M, 16] x
  [16, BLOCK_N] dots.

Tokens of slot 0 (no adapter) and slices of rank 0 read no weights; only the first `rank` rows
of A are read, and of B only the 16-column chunks that hold its first `rank` columns.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    cdiv,
    check_launchable,
    check_tensor,
    next_pow2,
    num_sms,
    upcast_loads,
)

MAX_SLICES = 4
# Batches up to this many tokens take the per-token (GEMV) path.
MAX_GEMV_TOKENS = 512
# Rank columns of B per expand step (the K of the tile path's dots: at least 16).
RANK_CHUNK = 16


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int
    """Tokens per program: 1 is the per-token path, more a tile through `tl.dot`."""
    block_r: int
    """Per-token path: rank rows per program (the tile path takes all of max_rank)."""
    block_k: int
    """Input features per loop step."""
    k_splits: int
    """Tile path: programs sharing a tile's input dim (fp32 atomics when more than 1)."""
    num_warps: int
    num_stages: int = 3
    """Loop steps in flight (async copies through shared memory)."""


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int
    """Tokens per program: 1 is the per-token path, more a tile through `tl.dot`."""
    block_n: int
    """Output features per program."""
    num_warps: int
    num_stages: int = 2
    """Rank chunks in flight: 2 issues a chunk's loads as one batch of async copies (the
    compiler spreads plain loads over several round trips); 1 loads them plainly."""


@triton.jit
def _next_run(slots, todo):
    """Pick one slot still to do among a tile's tokens: (slot, its tokens, what remains)."""
    slot = tl.max(tl.where(todo, slots, -1), axis=0)
    run = todo & (slots == slot)
    return slot, run, todo & (slots != slot)


@triton.jit
def _shrink_rows_kernel(
    x_ptr, a_ptr, token_slots_ptr, ranks_ptr, out_ptr,
    in_features, max_rank,
    stride_x_tok, stride_a_slot, stride_a_slice, stride_a_rank, stride_ranks_slot,
    stride_out_slice, stride_out_tok,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    r0 = tl.program_id(0) * BLOCK_R
    tok = tl.program_id(1)
    slice_id = tl.program_id(2)
    r = r0 + tl.arange(0, BLOCK_R)  # [BLOCK_R] rows of this token's shrunk vector
    slot = tl.load(token_slots_ptr + tok)
    rank = tl.load(ranks_ptr + slot * stride_ranks_slot + slice_id)
    rank = tl.where(slot > 0, rank, 0)
    acc = tl.zeros([BLOCK_R], tl.float32)
    if r0 < rank:
        r_mask = r < rank
        a_rows = a_ptr + slot.to(tl.int64) * stride_a_slot + slice_id * stride_a_slice \
            + r[:, None] * stride_a_rank  # [BLOCK_R, 1]
        x_row = x_ptr + tok.to(tl.int64) * stride_x_tok
        part = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
        for k0 in tl.range(0, in_features, BLOCK_K, num_stages=NUM_STAGES):
            k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                xt = tl.load(x_row + k)
                at = tl.load(a_rows + k[None, :], mask=r_mask[:, None], other=0.0)
            else:
                xt = tl.load(x_row + k, mask=k < in_features, other=0.0)
                at = tl.load(a_rows + k[None, :], mask=r_mask[:, None] & (k < in_features)[None, :],
                             other=0.0)  # [BLOCK_R, BLOCK_K]: only the true rank's rows
            part += at.to(tl.float32) * xt.to(tl.float32)[None, :]
        acc = tl.sum(part, axis=1)
    out = out_ptr + slice_id * stride_out_slice + tok * stride_out_tok + r
    tl.store(out, acc, mask=r < max_rank)


@triton.jit
def _shrink_tiles_kernel(
    x_ptr, a_ptr, token_slots_ptr, ranks_ptr, out_ptr,
    num_tokens, in_features, k_per_split,
    stride_x_tok, stride_a_slot, stride_a_slice, stride_a_rank, stride_ranks_slot,
    stride_out_slice, stride_out_tok,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr, UPCAST: tl.constexpr,
):
    slice_id = tl.program_id(1)
    tok = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    slots = tl.load(token_slots_ptr + tok, mask=tok < num_tokens, other=0)
    todo = slots > 0
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, in_features)
    r = tl.arange(0, BLOCK_R)
    x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_x_tok  # [BLOCK_M, 1]
    while tl.max(todo.to(tl.int32), axis=0) > 0:
        slot, run, todo = _next_run(slots, todo)
        rank = tl.load(ranks_ptr + slot * stride_ranks_slot + slice_id)
        if rank > 0:
            a_rows = a_ptr + slot.to(tl.int64) * stride_a_slot + slice_id * stride_a_slice \
                + r[:, None] * stride_a_rank  # [BLOCK_R, 1]
            acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_mask = k < k_hi
                xt = tl.load(x_rows + k[None, :], mask=run[:, None] & k_mask[None, :], other=0.0)
                at = tl.load(a_rows + k[None, :], mask=(r < rank)[:, None] & k_mask[None, :],
                             other=0.0)  # [BLOCK_R, BLOCK_K]: only the true rank's rows
                if UPCAST:
                    xt = xt.to(tl.float32)
                    at = at.to(tl.float32)
                acc += tl.dot(xt, tl.trans(at))
            out = out_ptr + slice_id * stride_out_slice + tok[:, None] * stride_out_tok + r[None, :]
            mask = run[:, None] & (r < rank)[None, :]
            if ATOMIC:
                tl.atomic_add(out, acc, mask=mask)
            else:
                tl.store(out, acc, mask=mask)


@triton.jit
def _slice_bound(i, off0, off1, off2, off3, off4):
    return tl.where(i == 0, off0, tl.where(i == 1, off1, tl.where(i == 2, off2,
                    tl.where(i == 3, off3, off4))))


@triton.jit
def _slice_of(col, off1, off2, off3):
    """The slice holding output column col (offsets past the last slice equal out_features)."""
    return (col >= off1).to(tl.int32) + (col >= off2).to(tl.int32) + (col >= off3).to(tl.int32)


@triton.jit
def _load_rank_chunk(ptrs, mask, r, rank, max_rank, EVEN_R: tl.constexpr):
    """A chunk of rank columns ([..., RANK_CHUNK], last dim contiguous) in float32, zero past the
    rank. The chunk is loaded whole (one mask a row, so the loads stay 16 bytes wide); its lanes
    past the rank lie in the rank's own 32-byte sectors, and are dropped after the load (they
    may hold anything: B's padding is never trusted to be zero)."""
    if EVEN_R:
        t = tl.load(ptrs + r[None, :], mask=mask[:, None], other=0.0)
    else:
        t = tl.load(ptrs + r[None, :], mask=mask[:, None] & (r < max_rank)[None, :], other=0.0)
    return tl.where((r < rank)[None, :], t.to(tl.float32), 0.0)


@triton.jit
def _expand_kernel(
    y_ptr, shrunk_ptr, b_ptr, token_slots_ptr, ranks_ptr, scale_ptr, scaled_ptr, shift_ptr,
    num_tokens, out_features, max_rank, off0, off1, off2, off3, off4,
    stride_y_tok, stride_s_slice, stride_s_tok, stride_b_slot, stride_b_out, stride_ranks_slot,
    stride_scale_slot, stride_shift_slot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RANK_CHUNK: tl.constexpr,
    EVEN_R: tl.constexpr, NUM_STAGES: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SHIFT: tl.constexpr,
):
    col0 = tl.program_id(0) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features, possibly of several slices
    in_cols = cols < out_features
    first = _slice_of(col0, off1, off2, off3)
    last = _slice_of(tl.minimum(col0 + BLOCK_N, out_features) - 1, off1, off2, off3)
    tok = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    slots = tl.load(token_slots_ptr + tok, mask=tok < num_tokens, other=0)
    has_adapter = slots > 0
    # y's tile is loaded first, to be in flight with the weights (rows of slot 0: no bytes).
    y_tile = y_ptr + tok.to(tl.int64)[:, None] * stride_y_tok + cols[None, :]
    y_mask = has_adapter[:, None] & in_cols[None, :]
    y = tl.load(y_tile, mask=y_mask, other=0.0)
    delta = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    todo = has_adapter
    while tl.max(todo.to(tl.int32), axis=0) > 0:
        slot, run, todo = _next_run(slots, todo)
        b_rows = b_ptr + slot.to(tl.int64) * stride_b_slot + cols * stride_b_out  # [BLOCK_N]
        for s in range(first, last + 1):
            rank = tl.load(ranks_ptr + slot * stride_ranks_slot + s)
            c_mask = in_cols & (cols >= _slice_bound(s, off0, off1, off2, off3, off4)) \
                & (cols < _slice_bound(s + 1, off0, off1, off2, off3, off4))
            s_rows = shrunk_ptr + s * stride_s_slice + tok * stride_s_tok  # [BLOCK_M]
            for r0 in tl.range(0, rank, RANK_CHUNK, num_stages=NUM_STAGES):
                r = r0 + tl.arange(0, RANK_CHUNK)
                bt = _load_rank_chunk(b_rows[:, None], c_mask, r, rank, max_rank,
                                      EVEN_R)  # [BLOCK_N, RANK_CHUNK]
                st = _load_rank_chunk(s_rows[:, None], run, r, rank, max_rank,
                                      EVEN_R)  # [BLOCK_M, RANK_CHUNK]
                if BLOCK_M == 1:
                    delta += tl.sum(bt * st, axis=1)[None, :]
                else:
                    # shrunk stays float32: rounding it to bf16 cost up to ~0.07 on rank-64
                    # deltas, past the 6e-2 tolerance, on the H100. tf32x3 keeps float32's
                    # accuracy on the tensor cores (an "ieee" FMA dot at these shapes spills).
                    delta += tl.dot(st, tl.trans(bt), input_precision="tf32x3")
    if tl.max(has_adapter.to(tl.int32), axis=0) > 0:
        # y += delta in y's dtype, as the reference adds the rounded delta.
        out = y.to(tl.float32) + delta.to(y_ptr.dtype.element_ty).to(tl.float32)
        if HAS_SCALE:
            # DoRA / IA3 epilogue: y <- scale * (y + delta) + shift in float32, for the tokens
            # whose slot sets `scaled` (their scale row is read; other tokens' is not).
            is_scaled = tl.load(scaled_ptr + slots, mask=has_adapter, other=0) != 0  # [BLOCK_M]
            if tl.max(is_scaled.to(tl.int32), axis=0) > 0:
                s_mask = is_scaled[:, None] & in_cols[None, :]
                rows = slots.to(tl.int64)[:, None]
                scale = tl.load(scale_ptr + rows * stride_scale_slot + cols[None, :], mask=s_mask,
                                other=1.0)
                scaled_out = (y.to(tl.float32) + delta) * scale
                if HAS_SHIFT:
                    scaled_out += tl.load(shift_ptr + rows * stride_shift_slot + cols[None, :],
                                          mask=s_mask, other=0.0)
                out = tl.where(is_scaled[:, None], scaled_out, out)
        tl.store(y_tile, out, mask=y_mask)


# Per-token launch configs that the benchmark sweeps and the GPU tests check.
CANDIDATE_SHRINK_CONFIGS = [ShrinkConfig(1, block_r, block_k, 1, warps, stages)
                            for block_r, block_k, warps, stages in (
    (1, 2048, 4, 3), (2, 1024, 4, 3), (2, 2048, 4, 3), (4, 512, 4, 4), (4, 1024, 4, 1),
    (4, 1024, 4, 2), (4, 1024, 4, 3), (4, 1024, 8, 3), (8, 512, 4, 3), (16, 256, 4, 3),
)]
CANDIDATE_EXPAND_CONFIGS = [ExpandConfig(1, block_n, warps, stages)
                            for block_n, warps, stages in (
    (256, 2, 2), (256, 4, 2), (512, 4, 1), (512, 4, 2), (512, 8, 2), (1024, 4, 2), (1024, 8, 2),
)]
# Tile-path (shrink, expand) pairs, the first the default.
CANDIDATE_TILE_CONFIGS = [
    (ShrinkConfig(32, 16, 64, 4, 4, 3), ExpandConfig(32, 64, 4, 2)),
    (ShrinkConfig(32, 16, 128, 4, 4, 3), ExpandConfig(32, 128, 4, 2)),
    (ShrinkConfig(32, 16, 64, 8, 4, 3), ExpandConfig(32, 64, 4, 1)),
    (ShrinkConfig(32, 16, 64, 2, 4, 3), ExpandConfig(16, 128, 4, 2)),
]


def shrink_config(num_tokens: int, num_slices: int, in_features: int, max_rank: int,
                  device: torch.device) -> ShrinkConfig:
    """Per-token path up to MAX_GEMV_TOKENS tokens: 4 rank rows per program, halved until there
    are about two programs per SM (counting ranks up to 16, the common size), steps of 1024
    inputs, 3 in flight (on the H100 at 64 tokens, rank 16, this was the best or within 1% of
    it for qkv, o, gate_up and down; 8 or 16 rows, or plain loads, were slower).
    Tiles of 32 tokens above, the input dim split until there are about four programs per SM
    (chunks of at least 256)."""
    return _shrink_config(num_tokens, num_slices, in_features, max_rank, num_sms(device),
                          MAX_GEMV_TOKENS)


@functools.lru_cache(maxsize=1024)
def _shrink_config(num_tokens: int, num_slices: int, in_features: int, max_rank: int, sms: int,
                   max_gemv_tokens: int) -> ShrinkConfig:
    """shrink_config of its integers (cached: a step's wrappers ask for the same few shapes)."""
    if num_tokens <= max_gemv_tokens:
        typical_rank = min(max(max_rank, 1), 16)
        block_r = min(4, next_pow2(typical_rank))
        while block_r > 1 and cdiv(typical_rank, block_r) * num_tokens * num_slices < 2 * sms:
            block_r //= 2
        block_k = min(2048 if block_r == 1 else 1024, max(16, next_pow2(in_features)))
        return ShrinkConfig(block_m=1, block_r=block_r, block_k=block_k, k_splits=1, num_warps=4,
                            num_stages=3)
    programs = cdiv(num_tokens, 32) * num_slices
    k_splits = next_pow2(cdiv(4 * sms, programs))
    k_splits = max(1, min(k_splits, in_features // 256))
    return ShrinkConfig(block_m=32, block_r=max(16, next_pow2(max_rank)), block_k=64,
                        k_splits=k_splits, num_warps=4, num_stages=3)


_GEMV_EXPAND = ExpandConfig(block_m=1, block_n=256, num_warps=4, num_stages=2)
_TILE_EXPAND = ExpandConfig(block_m=32, block_n=64, num_warps=4)


def expand_config(num_tokens: int, max_rank: int) -> ExpandConfig:
    """Per-token path: 256 columns a program, 4 warps, async copies (the fastest on the H100 for
    qkv and gate_up at 64 tokens, rank 16, and within 2% for o and down). Tiles of 32 tokens by
    64 columns above."""
    return _GEMV_EXPAND if num_tokens <= MAX_GEMV_TOKENS else _TILE_EXPAND


def _check_slots(token_slots: torch.Tensor, ranks: torch.Tensor, num_tokens: int,
                 num_slots: int, num_slices: int) -> None:
    check_tensor("token_slots", token_slots, ndim=1, dtypes=INDEX_DTYPES, shape=(num_tokens,),
                 contiguous=True)
    check_tensor("ranks", ranks, ndim=2, dtypes=(torch.int32,), shape=(num_slots, num_slices))
    if ranks.stride(1) != 1:
        raise ValueError(f"ranks must have unit stride in its last dim (strides {ranks.stride()})")


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, ranks: torch.Tensor
) -> torch.Tensor:
    """x [num_tokens, in], lora_a [num_slots, num_slices, max_rank, in], token_slots
    [num_tokens] int (0 = no adapter), ranks [num_slots, num_slices] int32 -> float32
    [num_slices, num_tokens, max_rank], zero past each slot's rank and on rows of slot 0."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, in_features = x.shape
    check_tensor("lora_a", lora_a, ndim=4, dtypes=(x.dtype,), shape=(None, None, None, in_features))
    num_slots, num_slices, max_rank, _ = lora_a.shape
    if lora_a.stride(3) != 1 and in_features > 1:
        raise ValueError(f"lora_a must have unit stride in its last dim ({lora_a.stride()})")
    _check_slots(token_slots, ranks, num_tokens, num_slots, num_slices)
    device = check_launchable(_shrink_rows_kernel, (x, lora_a, token_slots, ranks))
    config = shrink_config(num_tokens, num_slices, in_features, max_rank, device)
    return _launch_shrink(x, lora_a, token_slots, ranks, config)


def _launch_shrink(x, lora_a, token_slots, ranks, config: ShrinkConfig) -> torch.Tensor:
    num_tokens, in_features = x.shape
    num_slices, max_rank = lora_a.shape[1], lora_a.shape[2]
    if num_tokens == 0 or max_rank == 0 or config.block_m > 1:
        out = torch.zeros((num_slices, num_tokens, max_rank), dtype=torch.float32, device=x.device)
    else:  # every element has one writer
        out = torch.empty((num_slices, num_tokens, max_rank), dtype=torch.float32, device=x.device)
    if num_tokens == 0 or max_rank == 0:
        return out
    common = (x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), ranks.stride(0),
              out.stride(0), out.stride(1))
    if config.block_m == 1:
        grid = (cdiv(max_rank, config.block_r), num_tokens, num_slices)
        _shrink_rows_kernel[grid](
            x, lora_a, token_slots, ranks, out, in_features, max_rank, *common,
            BLOCK_R=config.block_r, BLOCK_K=config.block_k,
            EVEN_K=in_features % config.block_k == 0, NUM_STAGES=config.num_stages,
            num_warps=config.num_warps,
        )
        return out
    k_per_split = cdiv(cdiv(in_features, config.k_splits), config.block_k) * config.block_k
    grid = (cdiv(num_tokens, config.block_m), num_slices, cdiv(in_features, k_per_split))
    _shrink_tiles_kernel[grid](
        x, lora_a, token_slots, ranks, out, num_tokens, in_features, k_per_split, *common,
        BLOCK_M=config.block_m, BLOCK_R=max(16, next_pow2(max_rank)), BLOCK_K=config.block_k,
        ATOMIC=grid[2] > 1, UPCAST=upcast_loads(x.dtype), num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def lora_expand(
    y: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
    ranks: torch.Tensor, slice_offsets: tuple[int, ...], scale: torch.Tensor | None = None,
    scaled: torch.Tensor | None = None, shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [num_tokens, out] += per slice s: shrunk[s] @ lora_b[slot, off_s:off_{s+1}, :rank].T,
    in place, and returned. shrunk [num_slices, num_tokens, max_rank] float32 (zero past each
    slot's rank, as lora_shrink leaves it), lora_b [num_slots, out, max_rank], slice_offsets
    (num_slices + 1 ints from 0 to out; at most 4 slices). The epilogue (DoRA, IA3), for
    tokens whose slot sets scaled [num_slots] int32: y <- scale[slot] * (y + delta) +
    shift[slot] in float32 (scale, shift [num_slots, out] float32, shift optional); slots that
    do not set it read no scale, so a plain LoRA batch reads one flag per token more."""
    check_tensor("y", y, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, out_features = y.shape
    check_tensor("lora_b", lora_b, ndim=3, dtypes=FLOAT_DTYPES, shape=(None, out_features, None))
    num_slots, _, max_rank = lora_b.shape
    if lora_b.stride(2) != 1 and max_rank > 1:
        raise ValueError(f"lora_b must have unit stride in its last dim ({lora_b.stride()})")
    num_slices = len(slice_offsets) - 1
    if not 1 <= num_slices <= MAX_SLICES:
        raise ValueError(f"expected 1..{MAX_SLICES} slices, got slice_offsets {slice_offsets}")
    offsets = [int(o) for o in slice_offsets]
    if offsets[0] != 0 or offsets[-1] != out_features or offsets != sorted(offsets):
        raise ValueError(f"slice_offsets {slice_offsets} must rise from 0 to {out_features}")
    check_tensor("shrunk", shrunk, ndim=3, dtypes=(torch.float32,),
                 shape=(num_slices, num_tokens, max_rank))
    _check_slots(token_slots, ranks, num_tokens, num_slots, num_slices)
    if (scale is None) != (scaled is None) or (shift is not None and scale is None):
        raise ValueError("give scale and scaled together (and shift only with them)")
    if scale is not None:
        for name, t in (("scale", scale), ("shift", shift)):
            if t is not None:
                check_tensor(name, t, ndim=2, dtypes=(torch.float32,), shape=(num_slots, out_features))
                if t.stride(1) != 1:
                    raise ValueError(f"{name} must have unit stride in its last dim ({t.stride()})")
        check_tensor("scaled", scaled, ndim=1, dtypes=(torch.int32,), shape=(num_slots,), contiguous=True)
    extra = [t for t in (scale, scaled, shift) if t is not None]
    check_launchable(_expand_kernel, (y, shrunk, lora_b, token_slots, ranks, *extra))
    return _launch_expand(y, shrunk, lora_b, token_slots, ranks, offsets,
                          expand_config(num_tokens, max_rank), scale, scaled, shift)


def _launch_expand(y, shrunk, lora_b, token_slots, ranks, offsets: list[int],
                   config: ExpandConfig, scale=None, scaled=None, shift=None) -> torch.Tensor:
    num_tokens, out_features = y.shape
    max_rank = lora_b.shape[2]
    if num_tokens == 0 or out_features == 0 or (max_rank == 0 and scale is None):
        return y
    grid = (cdiv(out_features, config.block_n), cdiv(num_tokens, config.block_m))
    # Per-token path: chunks no wider than a B row (max_rank 8 keeps 16-byte loads); the dots
    # of the tile path need K >= 16.
    chunk = RANK_CHUNK if config.block_m > 1 else min(RANK_CHUNK, next_pow2(max_rank))
    padded = offsets + [out_features] * (MAX_SLICES + 1 - len(offsets))
    has_scale, has_shift = scale is not None, shift is not None
    _expand_kernel[grid](
        y, shrunk, lora_b, token_slots, ranks, scale if has_scale else y,
        scaled if has_scale else token_slots, shift if has_shift else y,
        num_tokens, out_features, max_rank, *padded,
        y.stride(0), shrunk.stride(0), shrunk.stride(1), lora_b.stride(0), lora_b.stride(1),
        ranks.stride(0), scale.stride(0) if has_scale else 0, shift.stride(0) if has_shift else 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, RANK_CHUNK=chunk,
        EVEN_R=max_rank % chunk == 0, NUM_STAGES=config.num_stages, num_warps=config.num_warps,
        HAS_SCALE=has_scale, HAS_SHIFT=has_shift,
    )
    return y

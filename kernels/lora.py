"""Multi-LoRA shrink (x @ A^T) and expand (y += shrunk @ B^T) over stacked slices (q/k/v, or
gate/up), with a slot per token and no sorting metadata.

Both kernels tile the tokens in BLOCK_M rows, as given. Within a tile a program walks the
distinct slots of its tokens ("runs"): each run loads its slot's (slice's) weights once, for
all the tile's tokens of that slot. Tokens of slot 0 (no adapter) and slices of rank 0 cost
nothing, and only the first `rank` rows of A and columns of B are read (the padding up to
max_rank never is). Decode batches, where every token may carry another adapter, use
BLOCK_M = 1: a program per token, a GEMV on the CUDA cores, each adapter read once. Larger
batches (prefill chunks, whose tokens come in runs of one sequence) use BLOCK_M > 1 and
`tl.dot`, so a run's weights serve a whole tile.

- shrink: grid (token tiles, num_slices, k_splits); the input dim is split so that a small
  batch still has some programs per SM; partial sums go to the zeroed float32 output with fp32
  atomics (plain stores when k_splits is 1).
- expand: grid (token tiles, num_slices, column tiles of the widest slice); each output element
  has one owner, which adds its delta into y in place (no atomics). Tiles past a slice's width
  exit at once.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int
    block_k: int
    k_splits: int
    num_warps: int


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int
    block_n: int
    num_warps: int


@triton.jit
def _next_run(slots, todo):
    """Pick one slot still to do among a tile's tokens: (slot, its tokens, what remains)."""
    slot = tl.max(tl.where(todo, slots, -1), axis=0)
    run = todo & (slots == slot)
    return slot, run, todo & (slots != slot)


@triton.jit
def _lora_shrink_kernel(
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
                if BLOCK_M == 1:
                    acc += tl.sum(xt.to(tl.float32) * at.to(tl.float32), axis=1)[None, :]
                else:
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
def _lora_expand_kernel(
    y_ptr, shrunk_ptr, b_ptr, token_slots_ptr, ranks_ptr,
    num_tokens, off0, off1, off2, off3, off4,
    stride_y_tok, stride_s_slice, stride_s_tok, stride_b_slot, stride_b_out, stride_ranks_slot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    slice_id = tl.program_id(1)
    lo = _slice_bound(slice_id, off0, off1, off2, off3, off4)
    hi = _slice_bound(slice_id + 1, off0, off1, off2, off3, off4)
    col0 = lo + tl.program_id(2) * BLOCK_N
    if col0 >= hi:
        return
    cols = col0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features of this slice
    c_mask = cols < hi
    tok = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(token_slots_ptr + tok, mask=tok < num_tokens, other=0)
    todo = slots > 0
    r = tl.arange(0, BLOCK_R)
    y_tile = y_ptr + tok.to(tl.int64)[:, None] * stride_y_tok + cols[None, :]  # [BLOCK_M, BLOCK_N]
    s_rows = shrunk_ptr + slice_id * stride_s_slice + tok[:, None] * stride_s_tok + r[None, :]
    while tl.max(todo.to(tl.int32), axis=0) > 0:
        slot, run, todo = _next_run(slots, todo)
        rank = tl.load(ranks_ptr + slot * stride_ranks_slot + slice_id)
        if rank > 0:
            r_mask = r < rank
            bt = tl.load(b_ptr + slot.to(tl.int64) * stride_b_slot + cols[:, None] * stride_b_out
                         + r[None, :], mask=c_mask[:, None] & r_mask[None, :],
                         other=0.0)  # [BLOCK_N, BLOCK_R]: only the true rank's columns
            # [BLOCK_M, BLOCK_R]
            st = tl.load(s_rows, mask=run[:, None] & r_mask[None, :], other=0.0)
            if BLOCK_M == 1:
                delta = tl.sum(bt.to(tl.float32) * st, axis=1)[None, :]
            else:
                # shrunk stays float32 (rounding it to bf16 cost up to ~0.07 on rank-64 deltas,
                # past the 6e-2 tolerance, on the H100); the FMA path is cheap at K = rank.
                delta = tl.dot(st, tl.trans(bt.to(tl.float32)), input_precision="ieee")
            mask = run[:, None] & c_mask[None, :]
            y = tl.load(y_tile, mask=mask, other=0.0).to(tl.float32)
            # y += delta in y's dtype, as the reference adds the rounded delta.
            delta = delta.to(y_ptr.dtype.element_ty).to(tl.float32)
            tl.store(y_tile, y + delta, mask=mask)


# Per-token (BLOCK_M = 1) launch configs that the benchmark sweeps and the GPU tests check.
CANDIDATE_SHRINK_CONFIGS = [ShrinkConfig(1, block_k, splits, warps) for block_k, splits, warps in (
    (128, 4, 4), (128, 8, 4), (128, 16, 4), (256, 1, 4), (256, 2, 4), (256, 4, 4), (256, 8, 4),
    (256, 16, 4), (256, 4, 8), (256, 8, 8), (512, 2, 4), (512, 4, 4), (512, 8, 8),
)]
CANDIDATE_EXPAND_CONFIGS = [ExpandConfig(1, block_n, warps) for block_n, warps in (
    (64, 2), (128, 2), (128, 4), (256, 4), (256, 8), (512, 4), (512, 8),
)]


def shrink_config(num_tokens: int, num_slices: int, in_features: int, max_rank: int,
                  device: torch.device) -> ShrinkConfig:
    """GEMV path for up to MAX_GEMV_TOKENS tokens, tiles of 32 tokens above; split the input dim
    until there are about four programs per SM (chunks of at least 256)."""
    block_r = max(16, next_pow2(max_rank))
    block_m = 1 if num_tokens <= MAX_GEMV_TOKENS else 32
    block_k = max(32, min(256, 4096 // block_r)) if block_m == 1 else 64
    programs = cdiv(max(num_tokens, 1), block_m) * num_slices
    k_splits = next_pow2(cdiv(4 * num_sms(device), programs))
    k_splits = max(1, min(k_splits, in_features // 256))
    return ShrinkConfig(block_m=block_m, block_k=block_k, k_splits=k_splits, num_warps=4)


def expand_config(num_tokens: int, max_rank: int) -> ExpandConfig:
    block_m = 1 if num_tokens <= MAX_GEMV_TOKENS else 32
    block_n = 256 if block_m == 1 else 64
    block_n = min(block_n, max(32, 4096 // max(16, next_pow2(max_rank))))
    return ExpandConfig(block_m=block_m, block_n=block_n, num_warps=4)


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
    device = check_launchable(_lora_shrink_kernel, (x, lora_a, token_slots, ranks))
    config = shrink_config(num_tokens, num_slices, in_features, max_rank, device)
    return _launch_shrink(x, lora_a, token_slots, ranks, config)


def _launch_shrink(x, lora_a, token_slots, ranks, config: ShrinkConfig) -> torch.Tensor:
    num_tokens, in_features = x.shape
    num_slices, max_rank = lora_a.shape[1], lora_a.shape[2]
    out = torch.zeros((num_slices, num_tokens, max_rank), dtype=torch.float32, device=x.device)
    if num_tokens == 0 or max_rank == 0:
        return out
    k_per_split = cdiv(cdiv(in_features, config.k_splits), config.block_k) * config.block_k
    grid = (cdiv(num_tokens, config.block_m), num_slices, cdiv(in_features, k_per_split))
    _lora_shrink_kernel[grid](
        x, lora_a, token_slots, ranks, out, num_tokens, in_features, k_per_split,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), ranks.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_M=config.block_m, BLOCK_R=max(16, next_pow2(max_rank)), BLOCK_K=config.block_k,
        ATOMIC=grid[2] > 1, UPCAST=upcast_loads(x.dtype), num_warps=config.num_warps,
    )
    return out


def lora_expand(
    y: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
    ranks: torch.Tensor, slice_offsets: tuple[int, ...],
) -> torch.Tensor:
    """y [num_tokens, out] += per slice s: shrunk[s] @ lora_b[slot, off_s:off_{s+1}, :rank].T,
    in place, and returned. shrunk [num_slices, num_tokens, max_rank] float32, lora_b
    [num_slots, out, max_rank], slice_offsets (num_slices + 1 ints from 0 to out; at most
    4 slices)."""
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
    check_launchable(_lora_expand_kernel, (y, shrunk, lora_b, token_slots, ranks))
    return _launch_expand(y, shrunk, lora_b, token_slots, ranks, offsets,
                          expand_config(num_tokens, max_rank))


def _launch_expand(y, shrunk, lora_b, token_slots, ranks, offsets: list[int],
                   config: ExpandConfig) -> torch.Tensor:
    num_tokens, out_features = y.shape
    num_slices, max_rank = len(offsets) - 1, lora_b.shape[2]
    if num_tokens == 0 or max_rank == 0:
        return y
    widest = max(hi - lo for lo, hi in zip(offsets, offsets[1:]))
    grid = (cdiv(num_tokens, config.block_m), num_slices, cdiv(max(widest, 1), config.block_n))
    padded = offsets + [out_features] * (MAX_SLICES + 1 - len(offsets))
    _lora_expand_kernel[grid](
        y, shrunk, lora_b, token_slots, ranks, num_tokens, *padded,
        y.stride(0), shrunk.stride(0), shrunk.stride(1), lora_b.stride(0), lora_b.stride(1),
        ranks.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_R=max(16, next_pow2(max_rank)),
        num_warps=config.num_warps,
    )
    return y

"""The adapter kernels of lora.py and adapter_families.py reading weights through a page table
instead of dense slots (S-LoRA's unified paging), so that an adapter takes memory for its own
rank: rank pages of PAGE_RANK rows, anywhere in the pool that the KV cache shares.

Layout (per layer and module group; `pool` is the pool's bytes viewed as the weights' dtype,
`vectors` the same bytes viewed as float32; offsets count elements of those views):
- a_pages [num_slots, num_slices, max_pages] int64: rank page p of slice s's A, a dense
  [PAGE_RANK, in] block (rows p * PAGE_RANK.. of A) starting at pool[a_pages[slot, s, p]];
- b_pages [num_slots, num_slices, max_pages] int64: rank page p of slice s's B transposed, a
  dense [PAGE_RANK, width_s] block (scaling folded in for LoRA and DoRA; FLoRA's B unscaled);
- ranks [num_slots, num_slices] int32 as in lora.py: rows at and past the rank are never read
  (their table entries may name anything), nor is any row of slot 0;
- scale_at, shift_at [num_slots] int64: where a slot's float32 [out] vector starts in
  `vectors` (DoRA's magnitude over the row norm, IA3's output or input vector; shift:
  (1 - scale) * bias), -1 for none.
max_pages = cdiv(max_rank, PAGE_RANK). The tables are fixed-address tensors, CUDA-graph inputs:
an adapter that moves to other pages changes their values, never their addresses.

Each kernel is its slot twin with the row addresses gathered from the table (one int64 per
PAGE_RANK rows, cached): the per-token shrink looks up its BLOCK_R rows, the expand its rank
chunk's rows (B transposed: a rank row is `width_s` contiguous output features, so a chunk is
loaded as [RANK_CHUNK, BLOCK_N], the K x N operand of the tile path's dot as it is), FLoRA's
stack one A row a program and its combine the rows of its token's components. Launch configs are lora.py's
but the per-token expand's (paged_expand_config). Row starts carry alignment hints (row_align), so that
loads through gathered addresses stay 16 bytes wide. On the H100 (bench/results/kernels-paged-*.json,
scripts/paged-kernels-per-kernel.py), a Llama-3-8B decode step's adapter work at 64 tokens with 64
adapters takes 1.08x the slot kernels' time for LoRA, 1.04x DoRA, 0.97x IA3, 1.10x FLoRA: the
remainder is one more dependent load (the page) in kernels of 3-5 us.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from loraplex.kernels import lora
from loraplex.kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    cdiv,
    check_launchable,
    check_tensor,
    next_pow2,
    upcast_loads,
)
from loraplex.kernels.lora import (
    MAX_SLICES,
    RANK_CHUNK,
    ExpandConfig,
    ShrinkConfig,
    _next_run,
    _slice_bound,
    _slice_of,
    expand_config,
    shrink_config,
)
from loraplex.kernels.reference import PAGE_RANK, LoneSplit, num_rank_pages
from loraplex.kernels.reference import lone_split as reference_lone_split

SPLIT_LONE = True
"""In steps past lora.MAX_GEMV_TOKENS tokens (the tile path), the tokens whose neighbours carry
other adapters (decode rows beside other adapters' rows; `reference.lone_split`) go through the
per-token kernels, the rest through the tiles. Without the split, a 32-token tile of decode rows
with distinct adapters runs the input dimension once per adapter, one after another in one
program: on the H200, 112 decodes with 112 adapters beside a 768-token prompt cost 67.5 ms
against 40.5 ms with one adapter (studies/mixed_adapters_cost.py). A switch so that a GPU can
measure both (studies/lone_rows.py); read at launch (and at a graph's capture)."""


def lone_split(token_slots: torch.Tensor) -> LoneSplit | None:
    """The split of a step's tokens between the tiles and the per-token kernels
    (reference.lone_split), or None where the step takes the per-token path whole or SPLIT_LONE
    is off. Device ops only (no host sync): a CUDA graph captures it. The model runner makes it
    once a forward pass (LoraMetadata.split), and every shrink and expand follows it."""
    if not SPLIT_LONE or token_slots.shape[0] <= lora.MAX_GEMV_TOKENS:
        return None
    return reference_lone_split(token_slots)


@triton.jit
def _row_at(pages_ptr, r, mask, row_len, PAGE_RANK: tl.constexpr, ALIGN: tl.constexpr):
    """Element offsets of rows r (int64) of one (slot, slice) through its page row, each a
    multiple of ALIGN (see `row_align`: what lets the loads along a row be 16 bytes wide)."""
    page = tl.load(pages_ptr + r // PAGE_RANK, mask=mask, other=0)
    return tl.multiple_of(page + (r % PAGE_RANK).to(tl.int64) * row_len, ALIGN)


@triton.jit
def _shrink_rows_kernel(
    x_ptr, pool_ptr, a_pages_ptr, token_slots_ptr, token_list_ptr, ranks_ptr, out_ptr,
    in_features, max_rank,
    stride_x_tok, stride_p_slot, stride_p_slice, stride_ranks_slot, stride_out_slice, stride_out_tok,
    PAGE_RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, ALIGN: tl.constexpr, TOKEN_LIST: tl.constexpr,
):
    r0 = tl.program_id(0) * BLOCK_R
    tok = tl.program_id(1)
    slice_id = tl.program_id(2)
    if TOKEN_LIST:  # program i takes the i-th listed token (-1: none)
        tok = tl.load(token_list_ptr + tok)
    r = r0 + tl.arange(0, BLOCK_R)  # [BLOCK_R] rows of this token's shrunk vector
    slot = tl.load(token_slots_ptr + tl.maximum(tok, 0))
    rank = tl.load(ranks_ptr + slot * stride_ranks_slot + slice_id)
    rank = tl.where(slot > 0, rank, 0)
    rank = tl.where(tok >= 0, rank, -1)  # -1: no token, nothing stored
    tok = tl.maximum(tok, 0)
    acc = tl.zeros([BLOCK_R], tl.float32)
    if r0 < rank:
        r_mask = r < rank
        pages = a_pages_ptr + slot.to(tl.int64) * stride_p_slot + slice_id * stride_p_slice
        a_rows = pool_ptr + _row_at(pages, r, r_mask, in_features, PAGE_RANK, ALIGN)[:, None]  # [BLOCK_R, 1]
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
    tl.store(out, acc, mask=r < tl.where(rank >= 0, max_rank, 0))


@triton.jit
def _shrink_tiles_kernel(
    x_ptr, pool_ptr, a_pages_ptr, token_slots_ptr, ranks_ptr, out_ptr,
    num_tokens, in_features, k_per_split,
    stride_x_tok, stride_p_slot, stride_p_slice, stride_ranks_slot, stride_out_slice, stride_out_tok,
    PAGE_RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr, UPCAST: tl.constexpr, ALIGN: tl.constexpr,
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
            r_mask = r < rank
            pages = a_pages_ptr + slot.to(tl.int64) * stride_p_slot + slice_id * stride_p_slice
            a_rows = pool_ptr + _row_at(pages, r, r_mask, in_features, PAGE_RANK, ALIGN)[:, None]
            acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_mask = k < k_hi
                xt = tl.load(x_rows + k[None, :], mask=run[:, None] & k_mask[None, :], other=0.0)
                at = tl.load(a_rows + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
                if UPCAST:  # float32's accuracy on the tensor cores (plain tf32 is off by ~1e-3)
                    acc += tl.dot(xt.to(tl.float32), tl.trans(at.to(tl.float32)), input_precision="tf32x3")
                else:
                    acc += tl.dot(xt, tl.trans(at))
            out = out_ptr + slice_id * stride_out_slice + tok[:, None] * stride_out_tok + r[None, :]
            mask = run[:, None] & r_mask[None, :]
            if ATOMIC:
                tl.atomic_add(out, acc, mask=mask)
            else:
                tl.store(out, acc, mask=mask)


@triton.jit
def _expand_kernel(
    y_ptr, shrunk_ptr, pool_ptr, b_pages_ptr, token_slots_ptr, token_list_ptr, ranks_ptr, vectors_ptr,
    scale_at_ptr, shift_at_ptr,
    num_tokens, out_features, off0, off1, off2, off3, off4,
    stride_y_tok, stride_s_slice, stride_s_tok, stride_p_slot, stride_p_slice, stride_ranks_slot,
    PAGE_RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    RANK_CHUNK: tl.constexpr, NUM_STAGES: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_SHIFT: tl.constexpr, ALIGN: tl.constexpr, VEC_ALIGN: tl.constexpr, TOKEN_LIST: tl.constexpr,
):
    col0 = tl.program_id(0) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features, possibly of several slices
    in_cols = cols < out_features
    first = _slice_of(col0, off1, off2, off3)
    last = _slice_of(tl.minimum(col0 + BLOCK_N, out_features) - 1, off1, off2, off3)
    tok = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    if TOKEN_LIST:  # program i takes the i-th listed token(s) (-1: none)
        tok = tl.load(token_list_ptr + tok, mask=tok < num_tokens, other=-1)
        slots = tl.load(token_slots_ptr + tl.maximum(tok, 0), mask=tok >= 0, other=0)
        tok = tl.maximum(tok, 0)
    else:
        slots = tl.load(token_slots_ptr + tok, mask=tok < num_tokens, other=0)
    has_adapter = slots > 0
    y_tile = y_ptr + tok.to(tl.int64)[:, None] * stride_y_tok + cols[None, :]
    y_mask = has_adapter[:, None] & in_cols[None, :]
    y = tl.load(y_tile, mask=y_mask, other=0.0)
    delta = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    todo = has_adapter
    while tl.max(todo.to(tl.int32), axis=0) > 0:
        slot, run, todo = _next_run(slots, todo)
        for s in range(first, last + 1):
            rank = tl.load(ranks_ptr + slot * stride_ranks_slot + s)
            lo = _slice_bound(s, off0, off1, off2, off3, off4)
            hi = _slice_bound(s + 1, off0, off1, off2, off3, off4)
            # Slice bounds, out_features and each row's start are multiples of ALIGN: runs of
            # ALIGN columns are contiguous and masked alike (16-byte loads along a row of B).
            c_mask = tl.max_constancy(in_cols & (cols >= lo) & (cols < hi), ALIGN)
            c_off = tl.max_contiguous(tl.multiple_of(cols - lo, ALIGN), ALIGN)
            pages = b_pages_ptr + slot.to(tl.int64) * stride_p_slot + s * stride_p_slice
            s_rows = shrunk_ptr + s * stride_s_slice + tok * stride_s_tok  # [BLOCK_M]
            for r0 in tl.range(0, rank, RANK_CHUNK, num_stages=NUM_STAGES):
                r = r0 + tl.arange(0, RANK_CHUNK)
                r_mask = r < rank
                rows = _row_at(pages, r, r_mask, hi - lo, PAGE_RANK, ALIGN)  # [RANK_CHUNK]
                bt = tl.load(pool_ptr + rows[:, None] + c_off[None, :],
                             mask=r_mask[:, None] & c_mask[None, :],
                             other=0.0).to(tl.float32)  # [RANK_CHUNK, BLOCK_N]: B's rows, transposed
                st = tl.load(s_rows[:, None] + r[None, :], mask=run[:, None] & r_mask[None, :],
                             other=0.0)  # [BLOCK_M, RANK_CHUNK]
                if BLOCK_M == 1:
                    delta += tl.sum(bt * tl.trans(st), axis=0)[None, :]
                else:
                    delta += tl.dot(st, bt, input_precision="tf32x3")
    if tl.max(has_adapter.to(tl.int32), axis=0) > 0:
        out = y.to(tl.float32) + delta.to(y_ptr.dtype.element_ty).to(tl.float32)
        if HAS_SCALE:
            # DoRA / IA3 epilogue: y <- scale * (y + delta) + shift for tokens whose slot has
            # a scale vector (scale_at >= 0).
            scale_at = tl.load(scale_at_ptr + slots, mask=has_adapter, other=-1)  # [BLOCK_M]
            is_scaled = scale_at >= 0
            if tl.max(is_scaled.to(tl.int32), axis=0) > 0:
                s_mask = tl.max_constancy(is_scaled[:, None] & in_cols[None, :], [1, VEC_ALIGN])
                scale_off = tl.max_contiguous(
                    tl.multiple_of(scale_at[:, None] + cols[None, :], [1, VEC_ALIGN]), [1, VEC_ALIGN])
                scale = tl.load(vectors_ptr + scale_off, mask=s_mask, other=1.0)
                scaled_out = (y.to(tl.float32) + delta) * scale
                if HAS_SHIFT:
                    shift_at = tl.load(shift_at_ptr + slots, mask=has_adapter, other=-1)
                    shift_off = tl.max_contiguous(
                        tl.multiple_of(shift_at[:, None] + cols[None, :], [1, VEC_ALIGN]), [1, VEC_ALIGN])
                    scaled_out += tl.load(vectors_ptr + shift_off,
                                          mask=s_mask & (shift_at >= 0)[:, None], other=0.0)
                out = tl.where(is_scaled[:, None], scaled_out, out)
        tl.store(y_tile, out, mask=y_mask)


def row_align(pool: torch.Tensor, lengths) -> int:
    """The ALIGN hint of the kernels: 16 bytes in elements of the pool's dtype where every row
    length (and slice bound) in `lengths` is a multiple of it, else 1 (no hint). Row starts are
    aligned by contract: every rank page and vector the tables name starts on a 16-byte bound
    of the pool (adapter_pages.py packs them at PAGE_ALIGN = 256 bytes), and the pool is a
    whole allocation. Without the hint, loads through gathered addresses are one element wide."""
    return _row_align(pool.element_size(), tuple(int(n) for n in lengths))


@functools.lru_cache(maxsize=256)
def _row_align(element_size: int, lengths: tuple[int, ...]) -> int:
    vec = max(16 // element_size, 1)
    return vec if all(n % vec == 0 for n in lengths) else 1


def _check_pages(name: str, pages: torch.Tensor, num_slices: int, max_rank: int) -> None:
    check_tensor(name, pages, ndim=3, dtypes=(torch.int64,),
                 shape=(None, num_slices, num_rank_pages(max_rank)))
    if pages.stride(2) != 1:
        raise ValueError(f"{name} must have unit stride in its last dim ({pages.stride()})")


def _check_slots(token_slots, ranks, num_tokens: int, num_slots: int, num_slices: int) -> None:
    check_tensor("token_slots", token_slots, ndim=1, dtypes=INDEX_DTYPES, shape=(num_tokens,),
                 contiguous=True)
    check_tensor("ranks", ranks, ndim=2, dtypes=(torch.int32,), shape=(num_slots, num_slices))


def _check_pool(name: str, pool: torch.Tensor, dtypes) -> None:
    check_tensor(name, pool, ndim=1, dtypes=dtypes, contiguous=True)


def lora_shrink_paged(
    x: torch.Tensor, pool: torch.Tensor, a_pages: torch.Tensor, token_slots: torch.Tensor,
    ranks: torch.Tensor, max_rank: int, split: LoneSplit | None = None,
) -> torch.Tensor:
    """x [num_tokens, in], pool [pool_elements] (x's dtype), a_pages [num_slots, num_slices,
    cdiv(max_rank, PAGE_RANK)] int64, token_slots [num_tokens] (0 = no adapter), ranks
    [num_slots, num_slices] int32 -> float32 [num_slices, num_tokens, max_rank], zero past each
    slot's rank and on rows of slot 0 (as lora.lora_shrink). `split`: lone_split(token_slots)
    to share a tile-path step out between the tiles and the per-token kernel (None: every token
    in the tiles)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, in_features = x.shape
    _check_pool("pool", pool, (x.dtype,))
    check_tensor("ranks", ranks, ndim=2, dtypes=(torch.int32,))
    num_slices = ranks.shape[1]
    _check_pages("a_pages", a_pages, num_slices, max_rank)
    _check_slots(token_slots, ranks, num_tokens, a_pages.shape[0], num_slices)
    device = check_launchable(_shrink_rows_kernel, (x, pool, a_pages, token_slots, ranks))
    config = shrink_config(num_tokens, num_slices, in_features, max_rank, device)
    return _launch_shrink(x, pool, a_pages, token_slots, ranks, max_rank, config, split)


def lora_shrink_paged_unchecked(
    x: torch.Tensor, pool: torch.Tensor, a_pages: torch.Tensor, token_slots: torch.Tensor,
    ranks: torch.Tensor, max_rank: int, split: LoneSplit | None = None,
) -> torch.Tensor:
    """lora_shrink_paged without its argument checks, for inputs that meet its contract by
    construction (the engine's forward: `triton_ops(check_inputs=False)`)."""
    config = shrink_config(x.shape[0], ranks.shape[1], x.shape[1], max_rank, x.device)
    return _launch_shrink(x, pool, a_pages, token_slots, ranks, max_rank, config, split)


LONE_ROWS_TOKENS = 64
"""The token count whose per-token shrink config a tile-path step's lone tokens run with."""


def _launch_shrink(x, pool, a_pages, token_slots, ranks, max_rank: int, config: ShrinkConfig,
                   split: LoneSplit | None = None) -> torch.Tensor:
    num_tokens, in_features = x.shape
    num_slices = a_pages.shape[1]
    if num_tokens == 0 or max_rank == 0 or config.block_m > 1:
        out = torch.zeros((num_slices, num_tokens, max_rank), dtype=torch.float32, device=x.device)
    else:  # every element has one writer
        out = torch.empty((num_slices, num_tokens, max_rank), dtype=torch.float32, device=x.device)
    if num_tokens == 0 or max_rank == 0:
        return out
    common = (x.stride(0), a_pages.stride(0), a_pages.stride(1), ranks.stride(0), out.stride(0),
              out.stride(1))
    align = row_align(pool, (in_features,))
    split = split if config.block_m > 1 else None  # (the per-token path takes every token anyway)
    if config.block_m > 1:
        k_per_split = cdiv(cdiv(in_features, config.k_splits), config.block_k) * config.block_k
        grid = (cdiv(num_tokens, config.block_m), num_slices, cdiv(in_features, k_per_split))
        _shrink_tiles_kernel[grid](
            x, pool, a_pages, token_slots if split is None else split.run_slots, ranks, out, num_tokens,
            in_features, k_per_split, *common,
            PAGE_RANK=PAGE_RANK, BLOCK_M=config.block_m, BLOCK_R=max(16, next_pow2(max_rank)),
            BLOCK_K=config.block_k, ATOMIC=grid[2] > 1, UPCAST=upcast_loads(x.dtype), ALIGN=align,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        if split is None:
            return out
        config = lora.shrink_config(LONE_ROWS_TOKENS, num_slices, in_features, max_rank, x.device)
    rows = num_tokens if split is None else len(split.lone_tokens)
    _shrink_rows_kernel[(cdiv(max_rank, config.block_r), rows, num_slices)](
        x, pool, a_pages, token_slots, token_slots if split is None else split.lone_tokens, ranks, out,
        in_features, max_rank, *common,
        PAGE_RANK=PAGE_RANK, BLOCK_R=config.block_r, BLOCK_K=config.block_k,
        EVEN_K=in_features % config.block_k == 0, NUM_STAGES=config.num_stages, ALIGN=align,
        TOKEN_LIST=split is not None, num_warps=config.num_warps,
    )
    return out


def lora_expand_paged(
    y: torch.Tensor, shrunk: torch.Tensor, pool: torch.Tensor, b_pages: torch.Tensor,
    token_slots: torch.Tensor, ranks: torch.Tensor, slice_offsets: tuple[int, ...],
    vectors: torch.Tensor | None = None, scale_at: torch.Tensor | None = None,
    shift_at: torch.Tensor | None = None, split: LoneSplit | None = None,
) -> torch.Tensor:
    """y [num_tokens, out] += per slice s: shrunk[s] @ B_s[slot][:rank] (B_s transposed,
    [rank, width_s], in b_pages' rank pages of pool), in place, and returned. shrunk
    [num_slices, num_tokens, max_rank] float32 (as lora_shrink_paged leaves it), b_pages
    [num_slots, num_slices, cdiv(max_rank, PAGE_RANK)] int64, slice_offsets (num_slices + 1
    ints from 0 to out; at most 4 slices). The DoRA / IA3 epilogue, for tokens whose slot has
    scale_at[slot] >= 0 (scale_at, shift_at [num_slots] int64 into vectors, the pool as
    float32): y <- scale * (y + delta) + shift in float32 (shift where shift_at >= 0). `split`
    as lora_shrink_paged's."""
    check_tensor("y", y, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, out_features = y.shape
    _check_pool("pool", pool, FLOAT_DTYPES)
    num_slices = len(slice_offsets) - 1
    if not 1 <= num_slices <= MAX_SLICES:
        raise ValueError(f"expected 1..{MAX_SLICES} slices, got slice_offsets {slice_offsets}")
    offsets = [int(o) for o in slice_offsets]
    if offsets[0] != 0 or offsets[-1] != out_features or offsets != sorted(offsets):
        raise ValueError(f"slice_offsets {slice_offsets} must rise from 0 to {out_features}")
    check_tensor("shrunk", shrunk, ndim=3, dtypes=(torch.float32,), shape=(num_slices, num_tokens, None))
    max_rank = shrunk.shape[2]
    _check_pages("b_pages", b_pages, num_slices, max_rank)
    num_slots = b_pages.shape[0]
    _check_slots(token_slots, ranks, num_tokens, num_slots, num_slices)
    if (vectors is None) != (scale_at is None) or (shift_at is not None and scale_at is None):
        raise ValueError("give vectors and scale_at together (and shift_at only with them)")
    extra = []
    if scale_at is not None:
        _check_pool("vectors", vectors, (torch.float32,))
        for name, t in (("scale_at", scale_at), ("shift_at", shift_at)):
            if t is not None:
                check_tensor(name, t, ndim=1, dtypes=(torch.int64,), shape=(num_slots,), contiguous=True)
                extra.append(t)
        extra.append(vectors)
    check_launchable(_expand_kernel, (y, shrunk, pool, b_pages, token_slots, ranks, *extra))
    return _launch_expand(y, shrunk, pool, b_pages, token_slots, ranks, offsets,
                          paged_expand_config(num_tokens, max_rank), vectors, scale_at, shift_at, split)


def lora_expand_paged_unchecked(
    y: torch.Tensor, shrunk: torch.Tensor, pool: torch.Tensor, b_pages: torch.Tensor,
    token_slots: torch.Tensor, ranks: torch.Tensor, slice_offsets: tuple[int, ...],
    vectors: torch.Tensor | None = None, scale_at: torch.Tensor | None = None,
    shift_at: torch.Tensor | None = None, split: LoneSplit | None = None,
) -> torch.Tensor:
    """lora_expand_paged without its argument checks (as lora_shrink_paged_unchecked)."""
    config = paged_expand_config(y.shape[0], shrunk.shape[2])
    return _launch_expand(y, shrunk, pool, b_pages, token_slots, ranks, list(slice_offsets), config,
                          vectors, scale_at, shift_at, split)


GEMV_WARPS = 4
"""Warps of the per-token expand (256 columns each); scripts/paged-kernels-per-kernel.py sweeps it."""


def paged_expand_config(num_tokens: int, max_rank: int) -> ExpandConfig:
    """lora.expand_config's tiles; its per-token path as wide as its warps' columns (256 a warp,
    8 a thread), one rank page a loop step: a program's [PAGE_RANK, BLOCK_N] chunk of B
    transposed then lies in each thread's rows whole, so the sum over the rank stays in the
    thread (256 columns by 4 warps put the rows in different warps: a sum through shared
    memory and barriers, 3.4-4.3x the slot kernel's time on the H100)."""
    config = expand_config(num_tokens, max_rank)
    if config.block_m > 1:
        return config
    return _gemv_expand_config(GEMV_WARPS)


@functools.cache
def _gemv_expand_config(num_warps: int) -> ExpandConfig:
    return ExpandConfig(block_m=1, block_n=256 * num_warps, num_warps=num_warps, num_stages=2)


def expand_rank_chunk(config: ExpandConfig, max_rank: int) -> int:
    """Rank rows a loop step of the expand takes: RANK_CHUNK in the tiles, one rank page (or
    less, for smaller ranks) a step in the per-token path (paged_expand_config)."""
    return RANK_CHUNK if config.block_m > 1 else min(PAGE_RANK, next_pow2(max_rank))


def _launch_expand(y, shrunk, pool, b_pages, token_slots, ranks, offsets: list[int],
                   config: ExpandConfig, vectors=None, scale_at=None, shift_at=None,
                   split: LoneSplit | None = None) -> torch.Tensor:
    num_tokens, out_features = y.shape
    max_rank = shrunk.shape[2]
    if num_tokens == 0 or out_features == 0 or (max_rank == 0 and scale_at is None):
        return y
    split = split if config.block_m > 1 else None  # (the per-token path takes every token anyway)
    if split is None:  # (slots, token list: none, its length)
        launches = [(config, token_slots, None, num_tokens)]
    else:  # the tiles on the runs, then the per-token kernel on the listed tokens
        launches = [(config, split.run_slots, None, num_tokens),
                    (_gemv_expand_config(GEMV_WARPS), token_slots, split.lone_tokens, len(split.lone_tokens))]
    padded = offsets + [out_features] * (MAX_SLICES + 1 - len(offsets))
    has_scale, has_shift = scale_at is not None, shift_at is not None
    for config, slots, token_list, rows in launches:
        grid = (cdiv(out_features, config.block_n), cdiv(rows, config.block_m))
        _expand_kernel[grid](
            y, shrunk, pool, b_pages, slots, slots if token_list is None else token_list, ranks,
            vectors if has_scale else y, scale_at if has_scale else b_pages,
            shift_at if has_shift else b_pages, rows, out_features, *padded,
            y.stride(0), shrunk.stride(0), shrunk.stride(1), b_pages.stride(0), b_pages.stride(1),
            ranks.stride(0),
            PAGE_RANK=PAGE_RANK, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            RANK_CHUNK=expand_rank_chunk(config, max_rank), NUM_STAGES=config.num_stages,
            num_warps=config.num_warps, HAS_SCALE=has_scale, HAS_SHIFT=has_shift,
            ALIGN=row_align(pool, offsets), VEC_ALIGN=row_align(vectors, (out_features,)) if has_scale else 1,
            TOKEN_LIST=token_list is not None,
        )
    return y

"""adapter_families.py's kernels reading adapters through lora_paged.py's page tables (the DoRA /
IA3 output epilogue is in lora_paged.py's expand):
- scale_rows_paged: IA3's input vectors, x * vectors[scale_at[slot]:][:in] per token (1 where
  scale_at is -1), grid (tokens, column blocks);
- flora_stack_paged: FLoRA's rows a_k * x, a_k row k of its A through a_pages, in either of
  flora_stack's layouts;
- flora_combine_paged: flora_combine with b_k, row k of a slice's B transposed, through b_pages
  (FLoRA's B sits in the same rank pages as LoRA's: one layout for every family).
Grids, layouts and contracts are the slot kernels'; see adapter_families.py and reference.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels._common import FLOAT_DTYPES, INDEX_DTYPES, cdiv, check_launchable, check_tensor
from loraplex.kernels.adapter_families import BLOCK, COMBINE_ELEMENTS
from loraplex.kernels.lora import MAX_SLICES, _slice_of
from loraplex.kernels.lora_paged import PAGE_RANK, _check_pages, _check_pool, row_align


@triton.jit
def _scale_rows_kernel(x_ptr, vectors_ptr, scale_at_ptr, slots_ptr, out_ptr, in_features, stride_x,
                       stride_o, BLOCK: tl.constexpr):
    tok = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < in_features
    slot = tl.load(slots_ptr + tok)
    at = tl.load(scale_at_ptr + slot)
    x = tl.load(x_ptr + tok.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    has = (tl.zeros([BLOCK], tl.int64) + at) >= 0  # (a scalar mask is not broadcast under the interpreter)
    s = tl.load(vectors_ptr + at + cols, mask=mask & has, other=1.0)
    tl.store(out_ptr + tok.to(tl.int64) * stride_o + cols, x * s, mask=mask)


def scale_rows_paged(x: torch.Tensor, vectors: torch.Tensor, scale_at: torch.Tensor,
                     token_slots: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, in] -> x * scale per token, in x's dtype; the scale of a token's slot is
    the float32 vectors[scale_at[slot]:][:in] (vectors: the pool as float32), 1 where
    scale_at[slot] is -1 (slot 0 and slots that scale nothing)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, in_features = x.shape
    _check_pool("vectors", vectors, (torch.float32,))
    check_tensor("scale_at", scale_at, ndim=1, dtypes=(torch.int64,), contiguous=True)
    check_tensor("token_slots", token_slots, ndim=1, dtypes=INDEX_DTYPES, shape=(num_tokens,),
                 contiguous=True)
    check_launchable(_scale_rows_kernel, (x, vectors, scale_at, token_slots))
    out = torch.empty_like(x)
    if num_tokens and in_features:
        grid = (num_tokens, cdiv(in_features, BLOCK))
        _scale_rows_kernel[grid](x, vectors, scale_at, token_slots, out, in_features, x.stride(0),
                                 out.stride(0), BLOCK=BLOCK)
    return out


@triton.jit
def _flora_stack_kernel(x_ptr, pool_ptr, a_pages_ptr, flora_ranks_ptr, row_tokens_ptr, row_slots_ptr,
                        row_ranks_ptr, out_ptr, num_tokens, num_rows, block_rows, in_features, stride_x,
                        stride_p_slot, stride_p_slice, stride_fr_slot, stride_o,
                        PAGE_RANK: tl.constexpr, PER_SLICE: tl.constexpr, BLOCK: tl.constexpr,
                        ALIGN: tl.constexpr):
    p = tl.program_id(0)  # output row: block p // block_rows, row i of it (x's rows, then FLoRA's)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < in_features
    i = p % block_rows
    if i < num_tokens:
        own = tl.load(x_ptr + i.to(tl.int64) * stride_x + cols, mask=mask, other=0.0)
        tl.store(out_ptr + p.to(tl.int64) * stride_o + cols, own, mask=mask)
    else:
        q = i - num_tokens
        j = q % num_rows
        if PER_SLICE:
            s = p // block_rows
        else:
            s = q // num_rows
        tok = tl.load(row_tokens_ptr + j)
        slot = tl.load(row_slots_ptr + j).to(tl.int64)
        k = tl.load(row_ranks_ptr + j)
        rank = tl.load(flora_ranks_ptr + slot * stride_fr_slot + s)
        live = (k < rank) & (slot > 0)  # slot 0 (padding rows) is never an adapter
        entry = slot * stride_p_slot + s * stride_p_slice + k // PAGE_RANK
        page = tl.load(a_pages_ptr + tl.where(live, entry, 0))
        row = page + (k % PAGE_RANK).to(tl.int64) * in_features
        is_live = (tl.zeros([BLOCK], tl.int32) + live.to(tl.int32)) > 0  # (see _scale_rows_kernel)
        a_at = tl.max_contiguous(tl.multiple_of(row + cols, ALIGN), ALIGN)  # (lora_paged.row_align)
        a = tl.load(pool_ptr + a_at, mask=mask & is_live, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + tok.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + p.to(tl.int64) * stride_o + cols, tl.where(live, a * x, 0.0), mask=mask)


def flora_stack_paged(
    x: torch.Tensor, pool: torch.Tensor, a_pages: torch.Tensor, flora_ranks: torch.Tensor,
    row_tokens: torch.Tensor, row_slots: torch.Tensor, row_ranks: torch.Tensor, per_slice: bool,
) -> torch.Tensor:
    """flora_stack with FLoRA's A read through a_pages [num_slots, num_slices, max_pages] int64
    (rank pages of pool, x's dtype); flora_ranks [num_slots, num_slices] int32, row_* [num_rows]
    int (component row_ranks[j] < max_pages * PAGE_RANK). Same output layouts."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, in_features = x.shape
    _check_pool("pool", pool, (x.dtype,))
    check_tensor("a_pages", a_pages, ndim=3, dtypes=(torch.int64,))
    num_slots, num_slices = a_pages.shape[:2]
    _check_pages("a_pages", a_pages, num_slices, a_pages.shape[2] * PAGE_RANK)
    check_tensor("flora_ranks", flora_ranks, ndim=2, dtypes=(torch.int32,), shape=(num_slots, num_slices))
    num_rows = len(row_tokens)
    for name, t in (("row_tokens", row_tokens), ("row_slots", row_slots), ("row_ranks", row_ranks)):
        check_tensor(name, t, ndim=1, dtypes=INDEX_DTYPES, shape=(num_rows,), contiguous=True)
    check_launchable(_flora_stack_kernel, (x, pool, a_pages, flora_ranks, row_tokens, row_slots, row_ranks))
    num_out = num_slices * (num_tokens + num_rows) if per_slice else num_tokens + num_slices * num_rows
    out = torch.empty((num_out, in_features), dtype=x.dtype, device=x.device)
    if num_out and in_features:
        block_rows = num_tokens + num_rows if per_slice else num_out
        grid = (num_out, cdiv(in_features, BLOCK))
        _flora_stack_kernel[grid](
            x, pool, a_pages, flora_ranks, row_tokens, row_slots, row_ranks, out, num_tokens,
            max(num_rows, 1), block_rows, in_features, x.stride(0), a_pages.stride(0),
            a_pages.stride(1), flora_ranks.stride(0), out.stride(0),
            PAGE_RANK=PAGE_RANK, PER_SLICE=per_slice, BLOCK=BLOCK, ALIGN=row_align(pool, (in_features,)))
    return out


@triton.jit
def _flora_combine_kernel(y_ptr, p_ptr, pool_ptr, b_pages_ptr, slots_ptr, flora_ranks_ptr, bounds_ptr,
                          bias_ptr, num_tokens, num_rows, out_features, off1, off2, off3, stride_y,
                          stride_p_slot, stride_p_slice, stride_fr_slot, PAGE_RANK: tl.constexpr,
                          PER_SLICE: tl.constexpr, HAS_BIAS: tl.constexpr, RANK_BLOCK: tl.constexpr,
                          BLOCK: tl.constexpr, ALIGN: tl.constexpr, NUM_SLICES: tl.constexpr):
    tok = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_cols = cols < out_features
    s = _slice_of(cols, off1, off2, off3)  # [BLOCK] slice of each column
    lo_c = tl.where(s == 0, 0, tl.where(s == 1, off1, tl.where(s == 2, off2, off3))).to(tl.int64)
    hi_c = tl.where(s == 0, off1, tl.where(s == 1, off2, tl.where(s == 2, off3, out_features))).to(tl.int64)
    hi_c = tl.minimum(hi_c, out_features)
    if PER_SLICE:
        ld = hi_c - lo_c
        base = (num_tokens + num_rows) * lo_c - lo_c
        row0 = num_tokens + tl.zeros([BLOCK], tl.int64)
    else:
        ld = out_features + tl.zeros([BLOCK], tl.int64)
        base = tl.zeros([BLOCK], tl.int64)
        row0 = (num_tokens + s * num_rows).to(tl.int64)
    lo = tl.load(bounds_ptr + tok)
    hi = tl.load(bounds_ptr + tok + 1)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    acc = tl.load(p_ptr + base + tok * ld + cols, mask=in_cols, other=0.0).to(tl.float32)
    if hi > lo:
        ks = tl.arange(0, RANK_BLOCK)
        # Each slice's rank and page row once (scalars and [RANK_BLOCK] vectors), then picked
        # per column: gathered per element, they took 4-8x the slot kernel's time on the H100.
        rank = tl.zeros([BLOCK], tl.int32)
        page = tl.zeros([RANK_BLOCK, BLOCK], tl.int64)
        for i in tl.static_range(NUM_SLICES):
            rank_i = tl.load(flora_ranks_ptr + slot * stride_fr_slot + i)
            page_i = tl.load(b_pages_ptr + slot * stride_p_slot + i * stride_p_slice + ks // PAGE_RANK,
                             mask=ks < tl.minimum(rank_i, hi - lo), other=0)  # [RANK_BLOCK]
            rank = tl.where(s == i, rank_i, rank)
            page = tl.where((s == i)[None, :], page_i[:, None], page)
        # Slice bounds and out_features are multiples of ALIGN (lora_paged.row_align): runs of
        # ALIGN columns lie in one slice, contiguous in B's rows and the products, masked alike.
        live = tl.max_constancy((ks[:, None] < hi - lo) & in_cols[None, :] & (ks[:, None] < rank[None, :]),
                                [1, ALIGN])
        b_at = page + (ks[:, None] % PAGE_RANK).to(tl.int64) * (hi_c - lo_c)[None, :] \
            + (cols - lo_c)[None, :]
        b_at = tl.max_contiguous(tl.multiple_of(b_at, [1, ALIGN]), [1, ALIGN])
        b = tl.load(pool_ptr + b_at, mask=live, other=0.0).to(tl.float32)
        p_at = base[None, :] + (row0[None, :] + lo + ks[:, None]) * ld[None, :] + cols[None, :]
        p_at = tl.max_contiguous(tl.multiple_of(p_at, [1, ALIGN]), [1, ALIGN])
        p = tl.load(p_ptr + p_at, mask=live, other=0.0).to(tl.float32)
        flora = tl.sum(tl.where(live, b * p, 0.0), axis=0)
        acc = tl.where((rank > 0) & (slot > 0), flora, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)
    tl.store(y_ptr + tok.to(tl.int64) * stride_y + cols, acc, mask=in_cols)


def flora_combine_paged(
    products: torch.Tensor, pool: torch.Tensor, b_pages: torch.Tensor, token_slots: torch.Tensor,
    flora_ranks: torch.Tensor, bounds: torch.Tensor, slice_offsets: tuple[int, ...], num_rows: int,
    per_slice: bool, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """flora_combine with FLoRA's B read through b_pages [num_slots, num_slices, max_pages] int64
    (rank pages of pool, each [PAGE_RANK, width_s]: slice s's B transposed). Same products
    layouts, bounds and output. One launch."""
    num_tokens = len(token_slots)
    out_features = int(slice_offsets[-1])
    num_slices = len(slice_offsets) - 1
    if not 1 <= num_slices <= MAX_SLICES:
        raise ValueError(f"expected 1..{MAX_SLICES} slices, got slice_offsets {slice_offsets}")
    num_products = (num_tokens + num_rows) * out_features if per_slice else \
        (num_tokens + num_slices * num_rows) * out_features
    check_tensor("products", products, ndim=1, dtypes=FLOAT_DTYPES, shape=(num_products,), contiguous=True)
    _check_pool("pool", pool, FLOAT_DTYPES)
    check_tensor("b_pages", b_pages, ndim=3, dtypes=(torch.int64,), shape=(None, num_slices, None))
    max_rank = b_pages.shape[2] * PAGE_RANK
    check_tensor("flora_ranks", flora_ranks, ndim=2, dtypes=(torch.int32,),
                 shape=(b_pages.shape[0], num_slices))
    check_tensor("token_slots", token_slots, ndim=1, dtypes=INDEX_DTYPES, contiguous=True)
    check_tensor("bounds", bounds, ndim=1, dtypes=INDEX_DTYPES, shape=(num_tokens + 1,), contiguous=True)
    if bias is not None:
        check_tensor("bias", bias, ndim=1, shape=(out_features,), contiguous=True)
    tensors = [products, pool, b_pages, token_slots, flora_ranks, bounds]
    check_launchable(_flora_combine_kernel, tensors + ([bias] if bias is not None else []))
    y = torch.empty((num_tokens, out_features), dtype=products.dtype, device=products.device)
    if num_tokens == 0 or out_features == 0:
        return y
    padded = [int(o) for o in slice_offsets] + [out_features] * (MAX_SLICES + 1 - len(slice_offsets))
    rank_block = triton.next_power_of_2(max(max_rank, 1))
    block = max(COMBINE_ELEMENTS // rank_block, 64)  # [rank_block, block] tiles in registers
    grid = (num_tokens, cdiv(out_features, block))
    _flora_combine_kernel[grid](
        y, products, pool, b_pages, token_slots, flora_ranks, bounds, bias if bias is not None else y,
        num_tokens, num_rows, out_features, padded[1], padded[2], padded[3], y.stride(0),
        b_pages.stride(0), b_pages.stride(1), flora_ranks.stride(0), PAGE_RANK=PAGE_RANK,
        PER_SLICE=per_slice, HAS_BIAS=bias is not None, RANK_BLOCK=rank_block, BLOCK=block,
        ALIGN=min(row_align(pool, padded), row_align(products, padded)), NUM_SLICES=num_slices)
    return y

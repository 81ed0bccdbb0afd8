"""Kernels of the adapter families beside LoRA (the DoRA / IA3 output epilogue is in lora.py's
expand):
- scale_rows: IA3's input vectors, x * scales[slot] per token, grid (tokens, column blocks).
- flora_stack: FLoRA's rows a_k * x beside the batch's rows, so that the products with the
  base weight serve both; one launch, grid (output rows, column blocks). Two layouts: fused (x,
  then every slice's rows: one product with the whole fused weight, cheapest while the rows
  are few) and per_slice (for each slice of a fused q/k/v or gate/up weight, x then that
  slice's rows: one product per slice, so no row meets a slice whose output is thrown away;
  cheaper once the rows are many, see bench/results/flora-products-nvidia-h100-80gb-hbm3.json).
- flora_combine: y = each token's own product, and for a FLoRA token's adapted columns
  sum_k b_k * (W0 (a_k * x)) instead, plus bias, in one launch; grid (tokens, column blocks),
  each program loading all its token's rows at once (contiguous: the rows of one token come in
  turn, row bounds[t] + k is its component k; `bounds`, made with the step's inputs, says
  where) and B's rows b_k (FLoRA's B sits transposed in its slot, so a component's b_k is one
  contiguous row).
Padding rows (a graph's FLoRA rows past the step's) name slot 0, never an adapter: they are
zero, and no token's bounds reach them. Each program's loads take two round trips (the row's
token, slot and component, or the token's slot and bounds; then the slot's rank and the data):
at decode sizes these kernels are latency-bound, a few microseconds each.
All arithmetic in float32; loads are widened at once (bf16 arithmetic is wrong in the
interpreter)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels._common import FLOAT_DTYPES, INDEX_DTYPES, cdiv, check_launchable, check_tensor
from loraplex.kernels.lora import MAX_SLICES, _slice_of

BLOCK = 1024
COMBINE_ELEMENTS = 8192
"""flora_combine's tile: rank components x columns (512 columns at max rank 16)."""


@triton.jit
def _scale_rows_kernel(x_ptr, scales_ptr, slots_ptr, out_ptr, in_features, stride_x, stride_s,
                       stride_o, BLOCK: tl.constexpr):
    tok = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < in_features
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    x = tl.load(x_ptr + tok.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(scales_ptr + slot * stride_s + cols, mask=mask, other=1.0)
    tl.store(out_ptr + tok.to(tl.int64) * stride_o + cols, x * s, mask=mask)


def scale_rows(x: torch.Tensor, scales: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, in] -> x * scales[slot] per token, in x's dtype; scales [num_slots, in]
    float32 (row 0, and rows of slots that scale nothing, all 1)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, in_features = x.shape
    check_tensor("scales", scales, ndim=2, dtypes=(torch.float32,), shape=(None, in_features))
    check_tensor("token_slots", token_slots, ndim=1, dtypes=INDEX_DTYPES, shape=(num_tokens,),
                 contiguous=True)
    if x.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError("x and scales must have unit stride in their last dim")
    check_launchable(_scale_rows_kernel, (x, scales, token_slots))
    out = torch.empty_like(x)
    if num_tokens and in_features:
        grid = (num_tokens, cdiv(in_features, BLOCK))
        _scale_rows_kernel[grid](x, scales, token_slots, out, in_features, x.stride(0),
                                 scales.stride(0), out.stride(0), BLOCK=BLOCK)
    return out


@triton.jit
def _flora_stack_kernel(x_ptr, a_ptr, flora_ranks_ptr, row_tokens_ptr, row_slots_ptr, row_ranks_ptr,
                        out_ptr, num_tokens, num_rows, block_rows, in_features, stride_x,
                        stride_a_slot, stride_a_slice, stride_a_rank, stride_fr_slot, stride_o,
                        PER_SLICE: tl.constexpr, BLOCK: tl.constexpr):
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
        # Independent loads (one round trip), then the slot's rank and the rows (a second).
        tok = tl.load(row_tokens_ptr + j)
        slot = tl.load(row_slots_ptr + j).to(tl.int64)
        k = tl.load(row_ranks_ptr + j)
        rank = tl.load(flora_ranks_ptr + slot * stride_fr_slot + s)
        a = tl.load(a_ptr + slot * stride_a_slot + s * stride_a_slice + k * stride_a_rank + cols,
                    mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + tok.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        live = (k < rank) & (slot > 0)  # slot 0 (padding rows) is never an adapter
        tl.store(out_ptr + p.to(tl.int64) * stride_o + cols, tl.where(live, a * x, 0.0), mask=mask)


def flora_stack(
    x: torch.Tensor, lora_a: torch.Tensor, flora_ranks: torch.Tensor, row_tokens: torch.Tensor,
    row_slots: torch.Tensor, row_ranks: torch.Tensor, per_slice: bool,
) -> torch.Tensor:
    """x [num_tokens, in], lora_a [num_slots, num_slices, max_rank, in], flora_ranks
    [num_slots, num_slices] int32, row_tokens, row_slots and row_ranks [num_rows] int (row j:
    component k = row_ranks[j] < max_rank of token row_tokens[j], whose slot is row_slots[j]) ->
    the rows of the base products, a[slot, s, k] * x[t] for slice s (zero where k is past the
    slot's FLoRA rank of the slice; padding rows: slot 0, whose ranks are 0):
    - fused: [num_tokens + num_slices * num_rows, in]: x, then each slice's rows (one product
      with the whole fused weight);
    - per_slice: [num_slices * (num_tokens + num_rows), in]: for each slice, x then its rows
      (one product per slice of the weight: no row meets a slice it does not adapt).
    One launch. See reference.py."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, in_features = x.shape
    check_tensor("lora_a", lora_a, ndim=4, dtypes=(x.dtype,), shape=(None, None, None, in_features))
    num_slots, num_slices = lora_a.shape[:2]
    check_tensor("flora_ranks", flora_ranks, ndim=2, dtypes=(torch.int32,), shape=(num_slots, num_slices))
    num_rows = len(row_tokens)
    for name, t in (("row_tokens", row_tokens), ("row_slots", row_slots), ("row_ranks", row_ranks)):
        check_tensor(name, t, ndim=1, dtypes=INDEX_DTYPES, shape=(num_rows,), contiguous=True)
    if x.stride(1) != 1 or lora_a.stride(3) != 1 or flora_ranks.stride(1) != 1:
        raise ValueError("x, lora_a and flora_ranks must have unit stride in their last dim")
    check_launchable(_flora_stack_kernel, (x, lora_a, flora_ranks, row_tokens, row_slots, row_ranks))
    num_out = num_slices * (num_tokens + num_rows) if per_slice else num_tokens + num_slices * num_rows
    out = torch.empty((num_out, in_features), dtype=x.dtype, device=x.device)
    if num_out and in_features:
        block_rows = num_tokens + num_rows if per_slice else num_out
        grid = (num_out, cdiv(in_features, BLOCK))
        _flora_stack_kernel[grid](
            x, lora_a, flora_ranks, row_tokens, row_slots, row_ranks, out, num_tokens,
            max(num_rows, 1), block_rows, in_features, x.stride(0), lora_a.stride(0),
            lora_a.stride(1), lora_a.stride(2), flora_ranks.stride(0), out.stride(0),
            PER_SLICE=per_slice, BLOCK=BLOCK)
    return out


@triton.jit
def _flora_combine_kernel(y_ptr, p_ptr, b_ptr, slots_ptr, flora_ranks_ptr, bounds_ptr, bias_ptr,
                          num_tokens, num_rows, out_features, off1, off2, off3, stride_y,
                          stride_b_slot, stride_b_rank, stride_fr_slot, PER_SLICE: tl.constexpr,
                          HAS_BIAS: tl.constexpr, RANK_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    tok = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_cols = cols < out_features
    s = _slice_of(cols, off1, off2, off3)  # [BLOCK] slice of each column
    # Where column c of product row i lies: base + i * ld + c (see flora_combine).
    if PER_SLICE:
        lo_c = tl.where(s == 0, 0, tl.where(s == 1, off1, off2)).to(tl.int64)
        hi_c = tl.where(s == 0, off1, tl.where(s == 1, off2, off3)).to(tl.int64)
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
        # All of the token's rows at once ([RANK_BLOCK, BLOCK]; it has at most max_rank), loaded
        # beside its rank: components past the rank of a column's slice are dropped after.
        ks = tl.arange(0, RANK_BLOCK)
        rows = (ks[:, None] < hi - lo) & in_cols[None, :]
        rank = tl.load(flora_ranks_ptr + slot * stride_fr_slot + s, mask=in_cols, other=0)
        b = tl.load(b_ptr + slot * stride_b_slot + ks[:, None] * stride_b_rank + cols[None, :],
                    mask=rows, other=0.0).to(tl.float32)
        p = tl.load(p_ptr + base[None, :] + (row0[None, :] + lo + ks[:, None]) * ld[None, :] + cols[None, :],
                    mask=rows, other=0.0).to(tl.float32)
        live = rows & (ks[:, None] < rank[None, :])
        flora = tl.sum(tl.where(live, b * p, 0.0), axis=0)
        acc = tl.where((rank > 0) & (slot > 0), flora, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)
    tl.store(y_ptr + tok.to(tl.int64) * stride_y + cols, acc, mask=in_cols)


def flora_combine(
    products: torch.Tensor, flora_b: torch.Tensor, token_slots: torch.Tensor, flora_ranks: torch.Tensor,
    bounds: torch.Tensor, slice_offsets: tuple[int, ...], num_rows: int, per_slice: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """-> y [num_tokens, out] in products' dtype: each token's own product, plus bias; where a
    token's FLoRA adapter adapts a slice, sum_k flora_b[slot, k, col] * (its row k's product)
    plus bias instead. flora_b [num_slots, max_rank, out]: FLoRA's B transposed. products: the
    base weight times flora_stack's rows (no bias), flattened: fused
    [(num_tokens + num_slices * num_rows) * out]; per_slice: slice s's
    [num_tokens + num_rows, width_s] block at (num_tokens + num_rows) * offset_s. bounds
    [num_tokens + 1] int: token t's rows are bounds[t]:bounds[t + 1], at most max_rank of them,
    row bounds[t] + k its component k (rows past bounds[num_tokens] are padding, never read).
    One launch. See reference.py."""
    num_tokens = len(token_slots)
    out_features = int(slice_offsets[-1])
    num_slices = len(slice_offsets) - 1
    if not 1 <= num_slices <= MAX_SLICES:
        raise ValueError(f"expected 1..{MAX_SLICES} slices, got slice_offsets {slice_offsets}")
    num_products = (num_tokens + num_rows) * out_features if per_slice else \
        (num_tokens + num_slices * num_rows) * out_features
    check_tensor("products", products, ndim=1, dtypes=FLOAT_DTYPES, shape=(num_products,), contiguous=True)
    check_tensor("flora_b", flora_b, ndim=3, dtypes=FLOAT_DTYPES, shape=(None, None, out_features))
    check_tensor("flora_ranks", flora_ranks, ndim=2, dtypes=(torch.int32,),
                 shape=(flora_b.shape[0], num_slices))
    check_tensor("token_slots", token_slots, ndim=1, dtypes=INDEX_DTYPES, contiguous=True)
    check_tensor("bounds", bounds, ndim=1, dtypes=INDEX_DTYPES, shape=(num_tokens + 1,), contiguous=True)
    if bias is not None:
        check_tensor("bias", bias, ndim=1, shape=(out_features,), contiguous=True)
    if flora_ranks.stride(1) != 1 or flora_b.stride(2) != 1:
        raise ValueError("flora_b and flora_ranks must have unit stride in their last dim")
    tensors = [products, flora_b, token_slots, flora_ranks, bounds]
    check_launchable(_flora_combine_kernel, tensors + ([bias] if bias is not None else []))
    y = torch.empty((num_tokens, out_features), dtype=products.dtype, device=products.device)
    if num_tokens == 0 or out_features == 0:
        return y
    padded = [int(o) for o in slice_offsets] + [out_features] * (MAX_SLICES + 1 - len(slice_offsets))
    rank_block = triton.next_power_of_2(max(flora_b.shape[1], 1))
    block = max(COMBINE_ELEMENTS // rank_block, 64)  # [rank_block, block] tiles in registers
    grid = (num_tokens, cdiv(out_features, block))
    _flora_combine_kernel[grid](
        y, products, flora_b, token_slots, flora_ranks, bounds, bias if bias is not None else y,
        num_tokens, num_rows, out_features, padded[1], padded[2], padded[3], y.stride(0),
        flora_b.stride(0), flora_b.stride(1), flora_ranks.stride(0), PER_SLICE=per_slice,
        HAS_BIAS=bias is not None, RANK_BLOCK=rank_block, BLOCK=block)
    return y

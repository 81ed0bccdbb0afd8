"""Kernels of the adapter families beside LoRA (the DoRA / IA3 output epilogue is in lora.py's
expand):
- scale_rows: IA3's input vectors, x * scales[slot] per token, grid (tokens, column blocks).
- flora_stack: FLoRA's rows a_k * x under the batch's rows, so that one product with the base
  weight serves both; grid (batch rows + slices * FLoRA rows, column blocks): one launch writes
  the batch's own rows and the FLoRA rows.
- flora_combine: each FLoRA token's adapted columns become sum_k b_k * (W0 (a_k * x)) + bias;
  grid (tokens, column blocks), each program walking its token's rows (contiguous: the rows of
  one token come in turn, tokens in order; `bounds`, made with the step's inputs, says where).
Padding rows (a graph's FLoRA rows past the step's) carry a rank past every slot's: they read
nothing, are zero, and no token's bounds reach them.
All arithmetic in float32; loads are widened at once (bf16 arithmetic is wrong in the
interpreter)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels._common import FLOAT_DTYPES, INDEX_DTYPES, cdiv, check_launchable, check_tensor
from loraplex.kernels.lora import MAX_SLICES, _slice_of

BLOCK = 1024


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
def _flora_stack_kernel(x_ptr, a_ptr, slots_ptr, flora_ranks_ptr, row_tokens_ptr, row_ranks_ptr,
                        out_ptr, num_tokens, num_rows, in_features, stride_x, stride_a_slot,
                        stride_a_slice, stride_a_rank, stride_fr_slot, stride_o, BLOCK: tl.constexpr):
    p = tl.program_id(0)  # output row: a token's own row, then slice s's FLoRA row j
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < in_features
    if p < num_tokens:
        own = tl.load(x_ptr + p.to(tl.int64) * stride_x + cols, mask=mask, other=0.0)
        tl.store(out_ptr + p.to(tl.int64) * stride_o + cols, own, mask=mask)
    else:
        s = (p - num_tokens) // num_rows
        j = (p - num_tokens) % num_rows
        tok = tl.load(row_tokens_ptr + j)
        k = tl.load(row_ranks_ptr + j)
        slot = tl.load(slots_ptr + tok).to(tl.int64)
        rank = tl.load(flora_ranks_ptr + slot * stride_fr_slot + s)
        live = cols < tl.where(k < rank, in_features, 0)  # [BLOCK]: none past the slot's rank
        a = tl.load(a_ptr + slot * stride_a_slot + s * stride_a_slice + k * stride_a_rank + cols,
                    mask=live, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + tok.to(tl.int64) * stride_x + cols, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + p.to(tl.int64) * stride_o + cols, a * x, mask=mask)


def flora_stack(
    x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, flora_ranks: torch.Tensor,
    row_tokens: torch.Tensor, row_ranks: torch.Tensor,
) -> torch.Tensor:
    """x [num_tokens, in], lora_a [num_slots, num_slices, max_rank, in], flora_ranks
    [num_slots, num_slices] int32, row_tokens and row_ranks [num_rows] int ->
    [num_tokens + num_slices * num_rows, in]: x, then per slice s the rows
    a[slot, s, k] * x[t] (zero past the slot's FLoRA rank of the slice: a padding row, of any
    token, has a rank past every slot's). One launch. See reference.py."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, in_features = x.shape
    check_tensor("lora_a", lora_a, ndim=4, dtypes=(x.dtype,), shape=(None, None, None, in_features))
    num_slots, num_slices = lora_a.shape[:2]
    check_tensor("flora_ranks", flora_ranks, ndim=2, dtypes=(torch.int32,), shape=(num_slots, num_slices))
    check_tensor("row_tokens", row_tokens, ndim=1, dtypes=INDEX_DTYPES, contiguous=True)
    check_tensor("row_ranks", row_ranks, ndim=1, dtypes=INDEX_DTYPES, shape=(len(row_tokens),),
                 contiguous=True)
    check_tensor("token_slots", token_slots, ndim=1, dtypes=INDEX_DTYPES, shape=(num_tokens,),
                 contiguous=True)
    if x.stride(1) != 1 or lora_a.stride(3) != 1 or flora_ranks.stride(1) != 1:
        raise ValueError("x, lora_a and flora_ranks must have unit stride in their last dim")
    check_launchable(_flora_stack_kernel, (x, lora_a, token_slots, flora_ranks, row_tokens, row_ranks))
    num_rows = len(row_tokens)
    out = torch.empty((num_tokens + num_slices * num_rows, in_features), dtype=x.dtype, device=x.device)
    if len(out) and in_features:
        grid = (len(out), cdiv(in_features, BLOCK))
        _flora_stack_kernel[grid](
            x, lora_a, token_slots, flora_ranks, row_tokens, row_ranks, out, num_tokens,
            max(num_rows, 1), in_features, x.stride(0), lora_a.stride(0), lora_a.stride(1),
            lora_a.stride(2), flora_ranks.stride(0), out.stride(0), BLOCK=BLOCK)
    return out


@triton.jit
def _flora_combine_kernel(y_ptr, p_ptr, b_ptr, slots_ptr, flora_ranks_ptr, row_ranks_ptr,
                          bounds_ptr, bias_ptr, num_rows, out_features, off1, off2, off3,
                          stride_y, stride_p, stride_b_slot, stride_b_out, stride_fr_slot,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    tok = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.load(bounds_ptr + tok)
    hi = tl.load(bounds_ptr + tok + 1)
    if hi > lo:
        in_cols = cols < out_features
        slot = tl.load(slots_ptr + tok).to(tl.int64)
        s = _slice_of(cols, off1, off2, off3)  # [BLOCK] slice of each column
        rank = tl.load(flora_ranks_ptr + slot * stride_fr_slot + s, mask=in_cols, other=0)
        acc = tl.zeros([BLOCK], tl.float32)
        for j in range(lo, hi):
            k = tl.load(row_ranks_ptr + j)
            live = in_cols & (k < rank)
            b = tl.load(b_ptr + slot * stride_b_slot + cols.to(tl.int64) * stride_b_out + k,
                        mask=live, other=0.0).to(tl.float32)
            p = tl.load(p_ptr + (s * num_rows + j).to(tl.int64) * stride_p + cols, mask=live,
                        other=0.0).to(tl.float32)
            acc += b * p
        adapted = in_cols & (rank > 0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=adapted, other=0.0).to(tl.float32)
        tl.store(y_ptr + tok.to(tl.int64) * stride_y + cols, acc, mask=adapted)


def flora_combine(
    y: torch.Tensor, products: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
    flora_ranks: torch.Tensor, row_ranks: torch.Tensor, bounds: torch.Tensor,
    slice_offsets: tuple[int, ...], bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [num_tokens, out], in place: each FLoRA token's adapted columns become
    sum_k b[slot, col, k] * products[s * num_rows + j, col] + bias over its rows j =
    bounds[t]:bounds[t + 1] (k = row_ranks[j]). products [num_slices * num_rows, out], row_ranks
    [num_rows], bounds [num_tokens + 1] int (rows past bounds[num_tokens] are padding, never
    read). See reference.py."""
    check_tensor("y", y, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, out_features = y.shape
    num_slices, num_rows = len(slice_offsets) - 1, len(row_ranks)
    if not 1 <= num_slices <= MAX_SLICES:
        raise ValueError(f"expected 1..{MAX_SLICES} slices, got slice_offsets {slice_offsets}")
    check_tensor("products", products, ndim=2, dtypes=FLOAT_DTYPES,
                 shape=(num_slices * num_rows, out_features))
    check_tensor("lora_b", lora_b, ndim=3, dtypes=FLOAT_DTYPES, shape=(None, out_features, None))
    check_tensor("flora_ranks", flora_ranks, ndim=2, dtypes=(torch.int32,),
                 shape=(lora_b.shape[0], num_slices))
    check_tensor("token_slots", token_slots, ndim=1, dtypes=INDEX_DTYPES, shape=(num_tokens,),
                 contiguous=True)
    check_tensor("row_ranks", row_ranks, ndim=1, dtypes=INDEX_DTYPES, contiguous=True)
    check_tensor("bounds", bounds, ndim=1, dtypes=INDEX_DTYPES, shape=(num_tokens + 1,), contiguous=True)
    if bias is not None:
        check_tensor("bias", bias, ndim=1, shape=(out_features,), contiguous=True)
    if y.stride(1) != 1 or products.stride(1) != 1 or flora_ranks.stride(1) != 1 or lora_b.stride(2) != 1:
        raise ValueError("y, products, lora_b and flora_ranks must have unit stride in their last dim")
    tensors = [y, products, lora_b, token_slots, flora_ranks, row_ranks, bounds]
    check_launchable(_flora_combine_kernel, tensors + ([bias] if bias is not None else []))
    if num_rows == 0 or num_tokens == 0:
        return y
    padded = [int(o) for o in slice_offsets] + [out_features] * (MAX_SLICES + 1 - len(slice_offsets))
    grid = (num_tokens, cdiv(out_features, BLOCK))
    _flora_combine_kernel[grid](
        y, products, lora_b, token_slots, flora_ranks, row_ranks, bounds,
        bias if bias is not None else y, num_rows, out_features, padded[1], padded[2], padded[3],
        y.stride(0), products.stride(0), lora_b.stride(0), lora_b.stride(1), flora_ranks.stride(0),
        HAS_BIAS=bias is not None, BLOCK=BLOCK)
    return y

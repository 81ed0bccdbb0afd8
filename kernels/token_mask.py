"""Structured outputs' token masks: the disallowed tokens of the masked rows set to -inf.

Grid (masked rows, vocab tiles): each program reads one tile of one masked row's logits and
the tile's 32-bit mask words, and writes -inf where a token's bit is clear, into a copy of the
logits (the caller keeps the model's own logits for logprobs). Unmasked rows are copied and
not read again; a row index of -1 is padding (a fixed-size row list, as a CUDA graph needs) and
does nothing."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels._common import FLOAT_DTYPES, check_launchable, check_tensor

BLOCK = 1024


@triton.jit
def _mask_logits_kernel(out_ptr, stride_row, vocab, rows_ptr, bitmask_ptr, num_words,
                        BLOCK_SIZE: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    row = tl.load(rows_ptr + i)
    if row < 0:
        return
    offs = tile * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    inside = offs < vocab
    words = tl.load(bitmask_ptr + i * num_words + (offs >> 5), mask=inside, other=0)
    allowed = ((words >> (offs & 31)) & 1) != 0
    ptrs = out_ptr + row * stride_row + offs
    tl.store(ptrs, tl.full([BLOCK_SIZE], float("-inf"), tl.float32).to(out_ptr.dtype.element_ty),
             mask=inside & ~allowed)


def mask_logits(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [batch, vocab] float, rows [m] int64 (rows of logits to mask; -1: padding),
    bitmask [m, >= ceil(vocab / 32)] int32 (bit j of word i set: token 32 i + j allowed) -> a copy
    of logits with -inf at the tokens each masked row's mask leaves out."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    batch, vocab = logits.shape
    check_tensor("rows", rows, ndim=1, dtypes=(torch.int64,), contiguous=True)
    check_tensor("bitmask", bitmask, ndim=2, dtypes=(torch.int32,), contiguous=True)
    num_masked, num_words = bitmask.shape
    if rows.shape[0] != num_masked:
        raise ValueError(f"rows has {rows.shape[0]} entries for {num_masked} bitmask rows")
    if num_words * 32 < vocab:
        raise ValueError(f"bitmask has {num_words} words a row: fewer than {vocab} tokens need")
    check_launchable(_mask_logits_kernel, (logits, rows, bitmask))
    out = logits.clone()
    if num_masked == 0 or batch == 0:
        return out
    _mask_logits_kernel[(num_masked, triton.cdiv(vocab, BLOCK))](
        out, out.stride(0), vocab, rows, bitmask, num_words, BLOCK_SIZE=BLOCK, num_warps=4)
    return out

"""Row-wise argmax (greedy sampling) in two stages, so one row is read by many SMs.

Stage 1, grid (rows, chunks): each program takes CHUNK values of a row and writes its max and
the first index of it. Stage 2, grid (rows,): the first chunk holding the row's max wins, so
ties go to the lowest index, as torch.argmax breaks them. A single-program-per-row argmax of a
128k vocabulary takes tens of microseconds; this takes a few."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels._common import FLOAT_DTYPES, check_launchable, check_tensor, next_pow2

CHUNK = 4096


@triton.jit
def _chunk_argmax_kernel(logits_ptr, stride_row, vocab, part_max_ptr, part_idx_ptr, num_chunks,
                         CHUNK_: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK_ + tl.arange(0, CHUNK_)
    v = tl.load(logits_ptr + row * stride_row + offs, mask=offs < vocab, other=float("-inf"))
    v = v.to(tl.float32)
    best = tl.max(v, axis=0)
    idx = tl.min(tl.where(v == best, offs, vocab), axis=0)
    tl.store(part_max_ptr + row * num_chunks + chunk, best)
    tl.store(part_idx_ptr + row * num_chunks + chunk, idx)


@triton.jit
def _merge_argmax_kernel(part_max_ptr, part_idx_ptr, num_chunks, out_ptr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    best = tl.load(part_max_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * num_chunks + c, mask=c < num_chunks, other=2**31 - 1)
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, idx, 2**31 - 1), axis=0)
    tl.store(out_ptr + row, token.to(tl.int64))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] (rows may be strided) -> int64 [rows]: the first index of each
    row's maximum (NaN-free input assumed, as sampling assumes)."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    check_launchable(_chunk_argmax_kernel, (logits,))
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    num_chunks = triton.cdiv(vocab, CHUNK)
    part_max = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((rows, num_chunks), dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(rows, num_chunks)](logits, logits.stride(0), vocab, part_max, part_idx,
                                             num_chunks, CHUNK_=CHUNK, num_warps=8)
    _merge_argmax_kernel[(rows,)](part_max, part_idx, num_chunks, out,
                                  BLOCK_C=max(16, next_pow2(num_chunks)), num_warps=1)
    return out

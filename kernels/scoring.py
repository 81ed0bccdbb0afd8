"""Scoring given tokens under rows of logits (prompt log-probabilities): for each row, the
target token's log-probability, its rank, and the row's most likely token with its
log-probability, in one read of the logits.

Stage 1, grid (rows, chunks): a program reads CHUNK logits of a row and writes their max, the
first index of it, the sum of exp(logit - max) and how many of them exceed the target's logit.
Stage 2, grid (rows,): merges the chunks (log-sum-exp rescaled to the row's max; ties of the
max go to the lowest index, as torch.argmax breaks them). torch needs five passes over the
logits for the same (logsumexp, comparison, sum, max)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels._common import check_launchable, check_tensor, next_pow2

CHUNK = 4096


@triton.jit
def _chunk_score_kernel(logits_ptr, stride_row, vocab, targets_ptr, part_ptr, num_chunks,
                        CHUNK_: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    base = logits_ptr + row * stride_row
    chosen = tl.load(base + tl.load(targets_ptr + row)).to(tl.float32)
    offs = chunk * CHUNK_ + tl.arange(0, CHUNK_)
    v = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    best = tl.max(v, axis=0)
    index = tl.min(tl.where(v == best, offs, vocab), axis=0)
    total = tl.sum(tl.exp(v - best), axis=0)
    above = tl.sum((v > chosen).to(tl.float32), axis=0)
    part = part_ptr + (row * num_chunks + chunk) * 4  # [rows, chunks, 4]: max, index, sum, above
    tl.store(part, best)
    tl.store(part + 1, index.to(tl.float32))
    tl.store(part + 2, total)
    tl.store(part + 3, above)


@triton.jit
def _merge_score_kernel(logits_ptr, stride_row, targets_ptr, part_ptr, num_chunks, out_ptr,
                        BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    mask = c < num_chunks
    part = part_ptr + (row * num_chunks + c) * 4
    best = tl.load(part, mask=mask, other=float("-inf"))
    index = tl.load(part + 1, mask=mask, other=3.0e38)
    total = tl.load(part + 2, mask=mask, other=0.0)
    above = tl.load(part + 3, mask=mask, other=0.0)
    top = tl.max(best, axis=0)
    lse = top + tl.log(tl.sum(total * tl.exp(best - top), axis=0))
    chosen = tl.load(logits_ptr + row * stride_row + tl.load(targets_ptr + row)).to(tl.float32)
    out = out_ptr + row * 4
    tl.store(out, chosen - lse)
    tl.store(out + 1, tl.sum(above, axis=0) + 1.0)
    tl.store(out + 2, top - lse)
    tl.store(out + 3, tl.min(tl.where(best == top, index, 3.0e38), axis=0))


def score_tokens(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] float32 (rows may be strided), targets [rows] int64 ->
    float32 [rows, 4]: log_softmax(logits)[target], the target's rank (1 + the tokens scored
    higher), the row's top log-probability and the first index of it (exact: vocab < 2**24)."""
    check_tensor("logits", logits, ndim=2, dtypes=(torch.float32,))
    rows, vocab = logits.shape
    check_tensor("targets", targets, ndim=1, dtypes=(torch.int64, torch.int32), shape=(rows,))
    check_launchable(_chunk_score_kernel, (logits, targets))
    if vocab >= 2**24:
        raise ValueError(f"score_tokens returns token ids as float32: vocab {vocab} is too large")
    out = torch.empty((rows, 4), dtype=torch.float32, device=logits.device)
    if rows == 0:
        return out
    num_chunks = triton.cdiv(vocab, CHUNK)
    part = torch.empty((rows, num_chunks, 4), dtype=torch.float32, device=logits.device)
    _chunk_score_kernel[(rows, num_chunks)](logits, logits.stride(0), vocab, targets, part, num_chunks,
                                            CHUNK_=CHUNK, num_warps=8)
    _merge_score_kernel[(rows,)](logits, logits.stride(0), targets, part, num_chunks, out,
                                 BLOCK_C=max(16, next_pow2(num_chunks)), num_warps=1)
    return out

"""Sampling on the GPU with no host sync: greedy, temperature, top-k then top-p, seeded per row.

One program per row (grid (batch,)), all decisions on the device:
1. one pass for the max and the first argmax; rows with temperature <= 0 stop there (greedy).
2. Rows with neither top-k nor top-p draw `argmax(logit / T + Gumbel)` over the whole row: the
   exponential race of the reference (`argmax(p / Exp(1))`), written in log space.
3. Otherwise a pass counts the tokens, and sums their (unnormalised) probability, within
   NUM_LEVELS distances of the max (0.5, 1, 2, ... nats after temperature, then everything),
   and picks the smallest level that surely holds the kept set: at least k tokens with top-k,
   else at least top_p of the mass. If that level has at most MAX_CAND tokens they are
   compacted (value, index) into a scratch row, and the searches below run over it; if not,
   over the whole row.
4. Exact thresholds by a multi-pivot search over order-preserving int32 keys of the float
   logits: top-k takes the largest key t with count(key >= t) >= k; top-p, over the top-k
   set, the smallest key v with mass(key > v) < top_p * mass(top-k set). Tokens tied at a
   threshold are all kept (the reference breaks such ties by sort order).
5. The Gumbel race over the kept tokens.
The noise of token i in a row is philox keyed by (seed, offset) at counter i, so a request's
draw depends only on its logits, seed and offset, never on the rest of the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels._common import FLOAT_DTYPES, check_launchable, check_tensor, next_pow2

BLOCK = 1024
MAX_CAND = 4096
NUM_LEVELS = 8
KEY_FLOOR = tl.constexpr(-2147483647)  # below the key of every float but NaN


# The interpreter pays about a millisecond for every call of a @triton.jit helper, so the
# per-tile work below is written inline in each loop; helpers are called once a program.
# A tile of the searched values is either the compacted candidates (from_cand) or the row
# itself; `key` is the order-preserving int32 key of the float32 value:
#     bits = v.to(tl.int32, bitcast=True); key = where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def num_pivots(block: int) -> int:
    """Pivots a search pass compares against: 16 (4 bits a pass) on full 1024-wide tiles, up
    to 256 (8 bits) on small vocabularies, keeping [pivots, block] at 16K elements."""
    return max(16, min(256, 16384 // block))


@triton.jit
def _row_argmax(row_ptr, vocab, BLOCK_SIZE: tl.constexpr):
    """(max, first index of the max) of the row."""
    best = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), axis=0)
    best_idx = tl.sum(tl.zeros([BLOCK_SIZE], tl.int32), axis=0)
    for start in range(0, vocab, BLOCK_SIZE):
        offs = start + tl.arange(0, BLOCK_SIZE)
        v = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        tile_best = tl.max(v, axis=0)
        tile_idx = tl.min(tl.where(v == tile_best, offs, vocab), axis=0)
        better = tile_best > best
        best_idx = tl.where(better, tile_idx, best_idx)
        best = tl.where(better, tile_best, best)
    return best, best_idx


@triton.jit
def _level_stats(row_ptr, vocab, row_max, inv_t, NUM_LEVELS_: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr):
    """Per level j: the tokens with (max - logit) / T <= reach_j, their count and summed
    exp((logit - max) / T). Returns (reach [L], count [L] int32, mass [L] float32)."""
    j = tl.arange(0, NUM_LEVELS_)
    reach = tl.where(j == NUM_LEVELS_ - 1, float("inf"), 0.5 * tl.exp2(j.to(tl.float32)))
    count = tl.zeros([NUM_LEVELS_], tl.int32)
    mass = tl.zeros([NUM_LEVELS_], tl.float32)
    for start in range(0, vocab, BLOCK_SIZE):
        offs = start + tl.arange(0, BLOCK_SIZE)
        mask = offs < vocab
        v = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        dist = (row_max - v) * inv_t  # [BLOCK], >= 0
        e = tl.exp2(-dist * 1.4426950408889634)
        inside = (dist[None, :] <= reach[:, None]) & mask[None, :]  # [L, BLOCK]
        count += tl.sum(inside.to(tl.int32), axis=1)
        mass += tl.sum(tl.where(inside, e[None, :], 0.0), axis=1)
    return reach, count, mass


@triton.jit
def _compact(row_ptr, cand_val_ptr, cand_idx_ptr, vocab, row_max, inv_t, max_dist,
             BLOCK_SIZE: tl.constexpr):
    """Writes the tokens within max_dist of the max, in vocab order, to the candidate row.
    Returns (how many, the smallest candidate value)."""
    n = tl.sum(tl.zeros([BLOCK_SIZE], tl.int32), axis=0)
    lowest = tl.max(tl.full([BLOCK_SIZE], float("inf"), tl.float32), axis=0)
    for start in range(0, vocab, BLOCK_SIZE):
        offs = start + tl.arange(0, BLOCK_SIZE)
        mask = offs < vocab
        v = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        inside = (((row_max - v) * inv_t) <= max_dist) & mask
        pos = n + tl.cumsum(inside.to(tl.int32), axis=0) - 1
        tl.store(cand_val_ptr + pos, v, mask=inside)
        tl.store(cand_idx_ptr + pos, offs, mask=inside)
        n += tl.sum(inside.to(tl.int32), axis=0)
        lowest = tl.minimum(lowest, tl.min(tl.where(inside, v, float("inf")), axis=0))
    return n, lowest


@triton.jit
def _sort_key(v):
    """float32 -> int32 with the same order (the comment at the top of this file)."""
    bits = v.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _load_tile(row_ptr, cand_val_ptr, offs, mask, from_cand):
    """float32 values at offs of the candidates (from_cand) or of the logits row; -inf past n."""
    if from_cand:
        v = tl.load(cand_val_ptr + offs, mask=mask, other=float("-inf"))
    else:
        v = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    return v


@triton.jit
def _topk_threshold(row_ptr, cand_val_ptr, n, from_cand, top_k, lo_key, hi_key,
                    NUM_PIVOTS_: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The largest key t with count(key >= t) >= top_k (the k-th largest key), searched in
    [lo_key, hi_key] with NUM_PIVOTS_ pivots a pass."""
    lo = lo_key.to(tl.int64)
    hi = hi_key.to(tl.int64)
    j = tl.arange(0, NUM_PIVOTS_).to(tl.int64) + 1
    while lo < hi:
        piv = lo + (j * (hi - lo + 1)) // (NUM_PIVOTS_ + 1)  # [P] in (lo, hi]
        piv32 = piv.to(tl.int32)
        count = tl.zeros([NUM_PIVOTS_], tl.int32)
        for start in range(0, n, BLOCK_SIZE):
            offs = start + tl.arange(0, BLOCK_SIZE)
            mask = offs < n
            v = _load_tile(row_ptr, cand_val_ptr, offs, mask, from_cand)
            key = _sort_key(v)
            above = (key[None, :] >= piv32[:, None]) & mask[None, :]  # [P, BLOCK]
            count += tl.sum(above.to(tl.int32), axis=1)
        ok = count >= top_k  # piv <= answer
        new_lo = tl.max(tl.where(ok, piv, lo), axis=0)
        hi = tl.min(tl.where(ok, hi, piv - 1), axis=0)
        lo = new_lo
    return lo.to(tl.int32)


@triton.jit
def _mass_from(row_ptr, cand_val_ptr, n, from_cand, min_key, row_max, scale,
               BLOCK_SIZE: tl.constexpr):
    """Sum of exp2((v - max) * scale) over the values with key >= min_key."""
    total = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), axis=0)
    for start in range(0, n, BLOCK_SIZE):
        offs = start + tl.arange(0, BLOCK_SIZE)
        mask = offs < n
        v = _load_tile(row_ptr, cand_val_ptr, offs, mask, from_cand)
        key = _sort_key(v)
        keep = mask & (key >= min_key)
        total += tl.sum(tl.where(keep, tl.exp2((v - row_max) * scale), 0.0), axis=0)
    return total


@triton.jit
def _topp_threshold(row_ptr, cand_val_ptr, n, from_cand, min_key, hi_key, target, row_max,
                    scale, NUM_PIVOTS_: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The smallest key v in [min_key, hi_key] with mass(key >= min_key, key > v) < target."""
    lo = min_key.to(tl.int64)
    hi = hi_key.to(tl.int64)
    j = tl.arange(0, NUM_PIVOTS_).to(tl.int64) + 1
    while lo < hi:
        piv = lo + (j * (hi - lo + 1)) // (NUM_PIVOTS_ + 1)  # [P] in (lo, hi]
        piv32 = piv.to(tl.int32)
        mass = tl.zeros([NUM_PIVOTS_], tl.float32)
        for start in range(0, n, BLOCK_SIZE):
            offs = start + tl.arange(0, BLOCK_SIZE)
            mask = offs < n
            v = _load_tile(row_ptr, cand_val_ptr, offs, mask, from_cand)
            key = _sort_key(v)
            e = tl.where(mask & (key >= min_key), tl.exp2((v - row_max) * scale), 0.0)
            above = key[None, :] > piv32[:, None]  # [P, BLOCK]
            mass += tl.sum(tl.where(above, e[None, :], 0.0), axis=1)
        ok = mass < target  # answer <= piv
        new_hi = tl.min(tl.where(ok, piv, hi), axis=0)
        lo = tl.max(tl.where(ok, lo, piv + 1), axis=0)
        hi = new_hi
    return lo.to(tl.int32)


@triton.jit
def _gumbel_argmax(row_ptr, cand_val_ptr, cand_idx_ptr, n, from_cand, min_key, inv_t, seed,
                   fallback, BLOCK_SIZE: tl.constexpr):
    """argmax over values with key >= min_key of logit / T + Gumbel(philox(seed, vocab index))."""
    best = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), axis=0)
    best_idx = fallback
    for start in range(0, n, BLOCK_SIZE):
        offs = start + tl.arange(0, BLOCK_SIZE)
        mask = offs < n
        if from_cand:
            v = tl.load(cand_val_ptr + offs, mask=mask, other=float("-inf"))
            idx = tl.load(cand_idx_ptr + offs, mask=mask, other=0)
        else:
            v = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
            idx = offs
        key = _sort_key(v)
        u = tl.rand(seed, idx)
        gumbel = -tl.log(-tl.log(u))
        g = tl.where(mask & (key >= min_key), v * inv_t + gumbel, float("-inf"))
        tile_best = tl.max(g, axis=0)
        tile_idx = tl.max(tl.where(g == tile_best, idx, -1), axis=0)
        better = tile_best > best
        best_idx = tl.where(better, tile_idx, best_idx)
        best = tl.where(better, tile_best, best)
    return best_idx


@triton.jit
def _sample_kernel(
    logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seeds_ptr, offsets_ptr, out_ptr,
    cand_val_ptr, cand_idx_ptr, vocab, stride_row,
    MAX_CAND_: tl.constexpr, NUM_PIVOTS_: tl.constexpr, NUM_LEVELS_: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    row_max, argmax = _row_argmax(row_ptr, vocab, BLOCK_SIZE)
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    if temperature <= 0.0:
        tl.store(out_ptr + row, argmax.to(tl.int64))
        return

    inv_t = 1.0 / tl.maximum(temperature, 1e-6)
    scale = inv_t * 1.4426950408889634  # exp2 units
    top_k = tl.load(top_k_ptr + row).to(tl.int32)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1.0
    seed = tl.load(seeds_ptr + row).to(tl.int64)
    offset = tl.load(offsets_ptr + row).to(tl.int64)
    key = ((seed ^ (seed >> 32)) << 32) | (offset & 0xFFFFFFFF)  # philox key per (seed, offset)
    cand_val = cand_val_ptr + row * MAX_CAND_
    cand_idx = cand_idx_ptr + row * MAX_CAND_

    min_key = tl.full([], KEY_FLOOR, tl.int32)
    n = tl.full([], 0, tl.int32) + vocab  # a tensor even if vocab was specialised
    from_cand = n < 0  # False
    if use_k | use_p:
        reach, count, mass = _level_stats(row_ptr, vocab, row_max, inv_t, NUM_LEVELS_,
                                          BLOCK_SIZE)
        total_mass = tl.max(mass, axis=0)  # the last level holds every token
        enough = tl.where(use_k, count >= top_k, mass >= top_p * total_mass * 1.0001)
        j = tl.arange(0, NUM_LEVELS_)
        level = tl.min(tl.where(enough, j, NUM_LEVELS_ - 1), axis=0)
        level_count = tl.sum(tl.where(j == level, count, 0), axis=0)
        lo_key = tl.full([], KEY_FLOOR, tl.int32)
        if level_count <= MAX_CAND_:
            max_dist = tl.sum(tl.where(j == level, reach, 0.0), axis=0)
            n, lowest = _compact(row_ptr, cand_val, cand_idx, vocab, row_max, inv_t, max_dist,
                                 BLOCK_SIZE)
            from_cand = n >= 0
            lo_key = _sort_key(lowest)
        hi_key = _sort_key(row_max)
        if use_k:
            min_key = _topk_threshold(row_ptr, cand_val, n, from_cand, top_k, lo_key, hi_key,
                                      NUM_PIVOTS_, BLOCK_SIZE)
        if use_p:
            if use_k:
                kept_mass = _mass_from(row_ptr, cand_val, n, from_cand, min_key, row_max, scale,
                                       BLOCK_SIZE)
            else:
                kept_mass = total_mass
            min_key = _topp_threshold(row_ptr, cand_val, n, from_cand, min_key, hi_key,
                                      top_p * kept_mass, row_max, scale, NUM_PIVOTS_, BLOCK_SIZE)
    token = _gumbel_argmax(row_ptr, cand_val, cand_idx, n, from_cand, min_key, inv_t, key,
                           argmax, BLOCK_SIZE)
    tl.store(out_ptr + row, token.to(tl.int64))


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    seeds: torch.Tensor, offsets: torch.Tensor,
) -> torch.Tensor:
    """logits [batch, vocab] (rows may be strided), temperature [batch] float (<= 0 = greedy),
    top_k [batch] int (<= 0 = off), top_p [batch] float (>= 1 = off), seeds, offsets [batch]
    int64 -> sampled token ids [batch] int64. The draw is a sample of the reference's
    distribution, reproducible for the same (seed, offset); its random stream differs."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    batch, vocab = logits.shape
    check_tensor("temperature", temperature, ndim=1, dtypes=FLOAT_DTYPES, shape=(batch,),
                 contiguous=True)
    check_tensor("top_k", top_k, ndim=1, dtypes=(torch.int32, torch.int64), shape=(batch,),
                 contiguous=True)
    check_tensor("top_p", top_p, ndim=1, dtypes=FLOAT_DTYPES, shape=(batch,), contiguous=True)
    check_tensor("seeds", seeds, ndim=1, dtypes=(torch.int64,), shape=(batch,), contiguous=True)
    check_tensor("offsets", offsets, ndim=1, dtypes=(torch.int64,), shape=(batch,),
                 contiguous=True)
    if vocab >= 2**31 - BLOCK:
        raise ValueError(f"vocab {vocab} too large")
    check_launchable(_sample_kernel, (logits, temperature, top_k, top_p, seeds, offsets))
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    block = min(BLOCK, next_pow2(vocab))
    cand_val = torch.empty((batch, MAX_CAND), dtype=torch.float32, device=logits.device)
    cand_idx = torch.empty((batch, MAX_CAND), dtype=torch.int32, device=logits.device)
    _sample_kernel[(batch,)](
        logits, temperature, top_k, top_p, seeds, offsets, out, cand_val, cand_idx,
        vocab, logits.stride(0),
        MAX_CAND_=MAX_CAND, NUM_PIVOTS_=num_pivots(block), NUM_LEVELS_=NUM_LEVELS,
        BLOCK_SIZE=block,
        num_warps=8,
    )
    return out

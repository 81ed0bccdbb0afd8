"""The attention tile loop that every paged attention kernel runs: stream one sequence's keys
and values of one KV head from the block-major cache in BLOCK_N-token tiles, gathered through
its block table, and fold them into an online softmax (running max m, running sum l,
unnormalised output acc) for a [M, head_dim] tile of query rows.

The state stays unnormalised so that a caller can run the loop over several token ranges (a
split of a sequence, a shared prefix and then a request's own blocks), and then either divide
(out = acc / l) or hand back a partial output with its log-sum-exp (m + log2(l), log2 units)
for a later merge. Scores are in log2 units: callers pass scale * LOG2E and the loop uses exp2.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# The running max a row starts from: finite, so that a tile whose scores a row may not see at
# all (-inf everywhere) leaves the row's state unchanged instead of making it NaN.
EMPTY_MAX = tl.constexpr(-1.0e30)


@triton.jit
def empty_state(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """(m_i [BLOCK_M] EMPTY_MAX, l_i [BLOCK_M] zeros, acc [BLOCK_M, BLOCK_D] zeros), float32:
    the state of rows that have seen no key."""
    m_i = tl.full([BLOCK_M], EMPTY_MAX, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    return m_i, l_i, acc


@triton.jit
def attend_paged_tiles(
    q, m_i, l_i, acc,
    kv_base, block_table, start, end,
    scale_log2, stride_kv_block, stride_kv_kv, stride_kv_tok, head_dim,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, q_pos=None,
):
    """Fold the keys and values of tokens [start, end) into the rows' state; returns the new
    (m_i, l_i, acc).

    q [M, BLOCK_D] (zeros past head_dim; float32 when UPCAST); m_i, l_i [M] and acc [M, BLOCK_D]
    float32, as empty_state makes them or as an earlier call left them. kv_base points
    at the K of this KV head in block 0, token 0 (its V is stride_kv_kv further on);
    block_table at the sequence's row of block ids: token n lives in block
    block_table[n // PAGE_SIZE], at slot n % PAGE_SIZE. A row sees every token in [start, end);
    with q_pos [M] (each row's position in the sequence) only those at positions <= its own
    (causal). A row that sees no token of a tile keeps its state, as long as its m_i is finite
    (EMPTY_MAX to begin with).
    """
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] token positions
        n_mask = n < end
        block = tl.load(block_table + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_off = (block * stride_kv_block + (n % PAGE_SIZE) * stride_kv_tok)[:, None] + d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(kv_base + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(kv_base + stride_kv_kv + kv_off, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale_log2  # [M, BLOCK_N], log2 units
        if q_pos is None:
            visible = n_mask[None, :]
        else:
            visible = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def fold_partial(m_i, l_i, acc, o_part, lse_part):
    """Fold a normalised partial output o_part [M, BLOCK_D] with its log-sum-exp lse_part [M]
    (log2 units; -inf = no key, o_part then 0) into the rows' state; returns the new
    (m_i, l_i, acc). The state's m_i must be finite (EMPTY_MAX to begin with). Once divided,
    the result is the exact two-way merge o = w * o_part + (1 - w) * o_state with
    w = sigmoid(lse_part - lse_state), in float32."""
    m_new = tl.maximum(m_i, lse_part)
    alpha = tl.exp2(m_i - m_new)
    beta = tl.exp2(lse_part - m_new)  # 0 for an empty partial
    return m_new, l_i * alpha + beta, acc * alpha[:, None] + o_part * beta[:, None]


@triton.jit
def find_segment(starts_ptr, pid, num_segments, TILE: tl.constexpr):
    """The last segment i whose first tile `starts[i] // TILE + i` is at or before pid (binary
    search; tile numbers grow with i). Segment i owns items starts[i]:starts[i + 1] (a
    sequence's query tokens, a relay group's members) and tiles starts[i] // TILE + i + j for
    j < cdiv(its items, TILE), so cdiv(total items, TILE) + num_segments programs cover any
    split of the items, a grid fixed by shapes alone."""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_segments - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(starts_ptr + mid) // TILE + mid
        if first <= pid:
            lo = mid
        else:
            hi = mid - 1
    return lo

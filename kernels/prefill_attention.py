"""Paged prefill attention: causal, variable-length, over the cached context (chunked prefill:
each sequence's new tokens are its last ones).

Grid (num_tokens // BLOCK_Q + num_seqs, num_kv_heads). Query blocks are numbered per sequence
from `query_start_loc[i] // BLOCK_Q + i`, which bounds the grid by shapes alone (no host read
of the query lengths); each program finds its sequence by binary search over
query_start_loc. A program takes BLOCK_Q new tokens times the q heads of one KV group as the M
rows of `tl.dot` ([BLOCK_Q * group, head_dim]), streams the keys up to its last token's
position in BLOCK_N tiles gathered through the block table, and writes the output and, when
asked, the log-sum-exp (natural log) of the scaled scores.

With `query_positions` each new token carries its own position (ascending within its sequence)
in place of the sequence's last ones: a program streams the keys up to its last row's position
and masks each row at its own. CacheBlend's recompute passes scattered tokens of a prompt whose
every key is cached already as one sequence this way, one pass over the prompt's keys for each
BLOCK_Q of them, where a sequence for each run of consecutive tokens would read the keys once
per run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.kernels._common import (
    FLOAT_DTYPES,
    check_kv_layer,
    check_launchable,
    check_tensor,
    next_pow2,
    upcast_loads,
)
from loraplex.kernels.attention_tiles import LOG2E, attend_paged_tiles, empty_state, find_segment

LN2 = tl.constexpr(0.6931471805599453)


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # rows of a program's q tile: BLOCK_Q tokens x next_pow2(group) heads
    block_n: int
    num_warps: int
    num_stages: int


@triton.jit
def _prefill_kernel(
    q_ptr, kv_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, positions_ptr, out_ptr,
    lse_ptr, stride_q_tok, stride_q_head, stride_kv_block, stride_kv_kv, stride_kv_tok, stride_kv_head,
    stride_bt_seq, stride_out_tok, stride_out_head, stride_lse_tok,
    scale_log2, num_seqs, group, head_dim,
    PAGE_SIZE: tl.constexpr, RETURN_LSE: tl.constexpr, BLOCK_Q: tl.constexpr,
    GROUP_P2: tl.constexpr, HAS_POSITIONS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = find_segment(query_start_loc_ptr, pid, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # tokens cached before this step's new ones

    rows = tl.arange(0, BLOCK_Q * GROUP_P2)
    t = q_block * BLOCK_Q + rows // GROUP_P2  # [BLOCK_M] new-token index within the sequence
    g = rows % GROUP_P2
    row_valid = (t < q_len) & (g < group)
    heads = kv_head * group + g
    tok = (q_start + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q = tl.load(q_ptr + tok[:, None] * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    if HAS_POSITIONS:  # ascending: the block's last row sits furthest
        q_pos = tl.load(positions_ptr + tok, mask=row_valid, other=-1)  # [BLOCK_M]
        kv_end = tl.max(q_pos) + 1
    else:
        q_pos = context + t  # [BLOCK_M]
        kv_end = context + tl.minimum((q_block + 1) * BLOCK_Q, q_len)  # last query position + 1
    m_i, l_i, acc = empty_state(BLOCK_Q * GROUP_P2, BLOCK_D)
    kv_base = kv_ptr + kv_head * stride_kv_head
    m_i, l_i, acc = attend_paged_tiles(
        q, m_i, l_i, acc, kv_base, block_tables_ptr + seq * stride_bt_seq, 0, kv_end,
        scale_log2, stride_kv_block, stride_kv_kv, stride_kv_tok, head_dim,
        PAGE_SIZE, BLOCK_N, BLOCK_D, UPCAST, q_pos=q_pos,
    )

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    out_off = tok[:, None] * stride_out_tok + heads[:, None] * stride_out_head + d[None, :]
    tl.store(out_ptr + out_off, out, mask=row_valid[:, None] & d_mask[None, :])
    if RETURN_LSE:
        lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * LN2,
                       float("-inf"))
        tl.store(lse_ptr + tok * stride_lse_tok + heads, lse, mask=row_valid)


# (block_m, block_n, num_warps, num_stages) that the benchmark sweeps and the GPU tests check.
CANDIDATE_CONFIGS = [PrefillConfig(*c) for c in (
    (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 32, 4, 3),
    (128, 32, 4, 3),
)]


def prefill_config(group: int, head_dim: int) -> PrefillConfig:
    """Launch config from shapes: 64 q rows (tokens x group heads) a program, 64-key tiles."""
    block_m = max(64, next_pow2(group))
    block_n = 64 if head_dim <= 128 else 32
    return PrefillConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=2)


def _check(q, kv_layer, block_tables, query_start_loc, seq_lens, query_positions=None) -> None:
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_kv_layer(kv_layer)
    num_heads, head_dim = q.shape[1], q.shape[2]
    if kv_layer.dtype != q.dtype:
        raise ValueError(f"kv_layer dtype {kv_layer.dtype} != q dtype {q.dtype}")
    if kv_layer.shape[4] != head_dim:
        raise ValueError(f"kv_layer head_dim {kv_layer.shape[4]} != q head_dim {head_dim}")
    if num_heads % kv_layer.shape[3]:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                         f"{kv_layer.shape[3]}")
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), contiguous=True)
    num_seqs = seq_lens.shape[0]
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,),
                 shape=(num_seqs + 1,), contiguous=True)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,),
                 shape=(num_seqs, None))
    if query_positions is not None:
        check_tensor("query_positions", query_positions, ndim=1, dtypes=(torch.int32,),
                     shape=(q.shape[0],), contiguous=True)


def paged_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    return_lse: bool = False, max_query_len: int | None = None,
    query_positions: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q [num_tokens, num_heads, head_dim] (each sequence's new tokens in turn), kv_layer
    [num_blocks, 2, block_size, num_kv_heads, head_dim] with the new tokens already stored,
    block_tables [num_seqs, max_blocks] int32, query_start_loc [num_seqs + 1] int32, seq_lens
    [num_seqs] int32 (including the new tokens) -> out [num_tokens, num_heads, head_dim] in q's
    dtype, and with return_lse also lse [num_tokens, num_heads] float32. Rows past
    query_start_loc[-1] are left unwritten. max_query_len is accepted for the op contract; the
    grid does not need it. query_positions [num_tokens] int32: each new token's own position
    (see reference.paged_attention)."""
    _check(q, kv_layer, block_tables, query_start_loc, seq_lens, query_positions)
    check_launchable(_prefill_kernel, (q, kv_layer, block_tables, query_start_loc, seq_lens,
                                       *(() if query_positions is None else (query_positions,))))
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.shape[3]
    config = prefill_config(num_heads // num_kv_heads, head_dim)
    return _launch(q, kv_layer, block_tables, query_start_loc, seq_lens, scale, return_lse,
                   config, query_positions)


def paged_attention_unchecked(
    q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    return_lse: bool = False, max_query_len: int | None = None,
    query_positions: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """paged_attention without its argument checks, for inputs that meet its contract by
    construction (the engine's forward: `triton_ops(check_inputs=False)`)."""
    config = prefill_config(q.shape[1] // kv_layer.shape[3], q.shape[2])
    return _launch(q, kv_layer, block_tables, query_start_loc, seq_lens, scale, return_lse,
                   config, query_positions)


def _launch(q, kv_layer, block_tables, query_start_loc, seq_lens, scale, return_lse,
            config: PrefillConfig, query_positions: torch.Tensor | None = None):
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_layer.shape[3], kv_layer.shape[2]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=q.device)
    if num_tokens > 0 and num_seqs > 0:
        group_p2 = next_pow2(group)
        block_q = max(1, config.block_m // group_p2)
        grid = (num_tokens // block_q + num_seqs, num_kv_heads)
        _prefill_kernel[grid](
            q, kv_layer, block_tables, query_start_loc, seq_lens,
            seq_lens if query_positions is None else query_positions, out, lse,
            q.stride(0), q.stride(1), kv_layer.stride(0), kv_layer.stride(1),
            kv_layer.stride(2), kv_layer.stride(3), block_tables.stride(0),
            out.stride(0), out.stride(1), lse.stride(0),
            scale * LOG2E, num_seqs, group, head_dim,
            PAGE_SIZE=block_size, RETURN_LSE=return_lse, BLOCK_Q=block_q, GROUP_P2=group_p2,
            HAS_POSITIONS=query_positions is not None,
            BLOCK_N=config.block_n, BLOCK_D=next_pow2(head_dim),
            UPCAST=upcast_loads(q.dtype),
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return (out, lse) if return_lse else out

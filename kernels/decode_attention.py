"""Paged decode attention (one new token per sequence): split-K flash-decoding over the
block-major cache.

Stage 1, grid (batch, num_kv_heads, num_splits): a program takes the q heads of one KV group
as the M rows of `tl.dot` ([BLOCK_H >= 16, head_dim]) and streams its split of the sequence's
keys and values in BLOCK_N-token tiles, gathered through the block table, with an online
softmax. Each sequence cuts its own length into num_splits equal, BLOCK_N-aligned chunks, so
splits past its length exit at once. With one split the program writes the output directly;
otherwise it writes a normalised partial output and its log-sum-exp, and stage 2, grid
(batch, num_heads), merges the splits. num_splits is a plain function of shapes (batch, KV
heads, the block table's capacity, the SM count), so the grid is fixed for a CUDA graph.
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
    num_sms,
    upcast_loads,
)
from loraplex.kernels.attention_tiles import LOG2E, attend_paged_tiles, empty_state, fold_partial

MAX_SPLITS = 32
MIN_TOKENS_PER_SPLIT = 64  # one BLOCK_N tile: short contexts at small batch get more splits


@dataclass(frozen=True)
class DecodeConfig:
    num_splits: int
    block_n: int
    num_warps: int
    num_stages: int


@triton.jit
def _decode_split_kernel(
    q_ptr, kv_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    kv_starts_ptr, prefix_out_ptr, prefix_lse_ptr,
    stride_q_seq, stride_q_head, stride_kv_block, stride_kv_kv, stride_kv_tok, stride_kv_head,
    stride_bt_seq, stride_out_seq, stride_out_head,
    scale_log2, num_heads, group, head_dim,
    PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, RELAY: tl.constexpr = False,
    PREFIX_SPLITS: tl.constexpr = 1,
):
    """With RELAY, a sequence's keys start at kv_starts[seq] (its shared prefix, attended by
    relay_attention, comes before), and its output folds in the prefix's PREFIX_SPLITS
    partials (prefix_out, prefix_lse; read only where kv_starts[seq] > 0): in this epilogue
    with one split, in the reduce kernel with several."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if RELAY:
        kv_start = tl.load(kv_starts_ptr + seq)
    else:
        kv_start = 0
    chunk = tl.cdiv(tl.cdiv(seq_len - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = kv_start + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * group + h  # [BLOCK_H] q heads of this KV group
    row_mask = (h < group)[:, None] & (d < head_dim)[None, :]
    out_off = seq * stride_out_seq + heads[:, None] * stride_out_head + d[None, :]
    # (one relay split goes on: the prefix may be all it has; a constexpr test, so nested)
    if NUM_SPLITS > 1 or not RELAY:  # noqa: SIM102
        if start >= end:
            if NUM_SPLITS == 1:  # seq_len 0 (padding): zeros
                tl.store(out_ptr + out_off, tl.zeros([BLOCK_H, BLOCK_D], tl.float32),
                         mask=row_mask)
            return

    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
                mask=row_mask, other=0.0)  # [BLOCK_H, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    m_i, l_i, acc = empty_state(BLOCK_H, BLOCK_D)
    kv_base = kv_ptr + kv_head * stride_kv_head
    m_i, l_i, acc = attend_paged_tiles(
        q, m_i, l_i, acc, kv_base, block_tables_ptr + seq * stride_bt_seq, start, end,
        scale_log2, stride_kv_block, stride_kv_kv, stride_kv_tok, head_dim,
        PAGE_SIZE, BLOCK_N, BLOCK_D, UPCAST,
    )

    if NUM_SPLITS == 1:
        if RELAY:
            has_prefix = h < tl.where(kv_start > 0, group, 0)  # [BLOCK_H]
            for s in tl.static_range(PREFIX_SPLITS):
                # prefix_out [batch, num_heads, PREFIX_SPLITS, BLOCK_D], prefix_lse [.., PREFIX_SPLITS]
                part = (seq * num_heads + heads) * PREFIX_SPLITS + s  # [BLOCK_H]
                lse_p = tl.load(prefix_lse_ptr + part, mask=has_prefix, other=float("-inf"))
                o_mask = (has_prefix & (lse_p > float("-inf")))[:, None] & row_mask
                o_p = tl.load(prefix_out_ptr + part[:, None] * BLOCK_D + d[None, :], mask=o_mask,
                              other=0.0)
                m_i, l_i, acc = fold_partial(m_i, l_i, acc, o_p, lse_p)
            l_i = tl.where(l_i > 0, l_i, 1.0)  # no key at all (padding): zeros
        tl.store(out_ptr + out_off, acc / l_i[:, None], mask=row_mask)
    else:
        # part_out [batch, num_heads, NUM_SPLITS, BLOCK_D], part_lse [batch, num_heads, NUM_SPLITS]
        part = (seq * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], acc / l_i[:, None],
                 mask=row_mask)
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=h < group)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, seq_lens_ptr, out_ptr, kv_starts_ptr, prefix_out_ptr,
    prefix_lse_ptr, stride_out_seq, stride_out_head, num_heads, head_dim,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, RELAY: tl.constexpr = False, PREFIX_SPLITS: tl.constexpr = 1,
    BLOCK_PS: tl.constexpr = 1,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    if RELAY:
        kv_start = tl.load(kv_starts_ptr + seq)
    else:
        kv_start = 0
    own_len = seq_len - kv_start
    chunk = tl.cdiv(tl.cdiv(own_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    valid = (s < NUM_SPLITS) & (s * chunk < own_len)  # splits stage 1 wrote
    part = (seq * num_heads + head) * NUM_SPLITS + s  # [BLOCK_S]
    lse = tl.load(part_lse_ptr + part, mask=valid, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    if RELAY:  # the prefix's partials join the splits
        ps = tl.arange(0, BLOCK_PS)
        p_part = (seq * num_heads + head) * PREFIX_SPLITS + ps  # [BLOCK_PS]
        p_valid = ps < tl.where(kv_start > 0, PREFIX_SPLITS, 0)
        lse_p = tl.load(prefix_lse_ptr + p_part, mask=p_valid, other=float("-inf"))
        p_valid = p_valid & (lse_p > float("-inf"))
        lse_max = tl.maximum(lse_max, tl.max(lse_p, axis=0))
    lse_max = tl.where(lse_max > float("-inf"), lse_max, 0.0)  # no valid split: all w = 0
    w = tl.exp2(lse - lse_max)  # [BLOCK_S]
    o = tl.load(part_out_ptr + part[:, None] * BLOCK_D + d[None, :],
                mask=valid[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    res = tl.sum(w[:, None] * o, axis=0)  # [BLOCK_D]
    if RELAY:
        w_p = tl.exp2(lse_p - lse_max)  # [BLOCK_PS]
        o_p = tl.load(prefix_out_ptr + p_part[:, None] * BLOCK_D + d[None, :],
                      mask=p_valid[:, None] & d_mask[None, :], other=0.0)
        total += tl.sum(w_p, axis=0)
        res += tl.sum(w_p[:, None] * o_p, axis=0)
    res = res / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + d, res, mask=d_mask)


# Launch configs (num_splits, block_n, num_warps, num_stages) that `loraplex bench kernels --sweep`
# times and the GPU tests check, so that any of them can become the default.
CANDIDATE_CONFIGS = [DecodeConfig(*c) for c in (
    (1, 64, 4, 4), (1, 64, 4, 3), (2, 64, 4, 4), (1, 32, 4, 4), (1, 32, 4, 5), (2, 32, 4, 5),
    (1, 64, 8, 4), (1, 16, 4, 5), (1, 128, 8, 4), (8, 64, 4, 4), (16, 64, 4, 4), (32, 64, 4, 4),
    (32, 32, 4, 5),
)]


def decode_config(batch: int, num_kv_heads: int, max_context: int, head_dim: int,
                  device: torch.device) -> DecodeConfig:
    """Launch config from shapes alone: enough splits that stage 1 has about two programs per
    SM, none shorter than MIN_TOKENS_PER_SPLIT tokens of the block table's capacity."""
    programs = max(batch * num_kv_heads, 1)
    wanted = next_pow2(-(-2 * num_sms(device) // programs))
    useful = max(1, max_context // MIN_TOKENS_PER_SPLIT)
    num_splits = max(1, min(wanted, useful, MAX_SPLITS))
    block_n = 64 if head_dim <= 128 else 32
    # The K/V loads depend on a block-table load, so the pipeliner spends a stage on the
    # indices: 4 stages keep one K/V tile in flight ahead of the one being used.
    return DecodeConfig(num_splits=num_splits, block_n=block_n, num_warps=4, num_stages=4)


def _check(q, kv_layer, block_tables, seq_lens) -> None:
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_kv_layer(kv_layer)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.shape[3]
    if kv_layer.dtype != q.dtype:
        raise ValueError(f"kv_layer dtype {kv_layer.dtype} != q dtype {q.dtype}")
    if kv_layer.shape[4] != head_dim:
        raise ValueError(f"kv_layer head_dim {kv_layer.shape[4]} != q head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,),
                 shape=(batch, None))
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), shape=(batch,),
                 contiguous=True)


def paged_decode_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, *, num_splits: int | None = None,
) -> torch.Tensor:
    """q [batch, num_heads, head_dim], kv_layer [num_blocks, 2, block_size, num_kv_heads,
    head_dim], block_tables [batch, max_blocks] int32, seq_lens [batch] int32 (including the
    new token; 0 = padding, gives zeros) -> out [batch, num_heads, head_dim] in q's dtype.
    num_splits overrides the split count chosen from the shapes (tests, tuning)."""
    _check(q, kv_layer, block_tables, seq_lens)
    device = check_launchable(_decode_split_kernel, (q, kv_layer, block_tables, seq_lens))
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_layer.shape[3], kv_layer.shape[2]
    config = decode_config(batch, num_kv_heads, block_tables.shape[1] * block_size, head_dim,
                           device)
    if num_splits is not None:
        if not 1 <= num_splits <= 1024:
            raise ValueError(f"num_splits must be in [1, 1024], got {num_splits}")
        config = DecodeConfig(num_splits, config.block_n, config.num_warps, config.num_stages)
    return _launch(q, kv_layer, block_tables, seq_lens, scale, config)


@dataclass(frozen=True)
class PrefixPartials:
    """What relay_attention hands the decode kernel: each sequence's keys start at kv_starts
    [batch] int32 (its shared prefix's length, 0 = none), and the prefix's normalised partial
    outputs out [batch, num_heads, num_splits, BLOCK_D] float32 with their log-sum-exps
    lse [batch, num_heads, num_splits] (log2 units, -inf = empty split), written where
    kv_starts > 0, are merged into its output."""

    kv_starts: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor

    @property
    def num_splits(self) -> int:
        return self.lse.shape[2]


def _launch(q, kv_layer, block_tables, seq_lens, scale: float, config: DecodeConfig,
            prefix: PrefixPartials | None = None):
    """Stage 1 (and 2); with `prefix`, the sequences' own keys only, merged with the prefix's."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_layer.shape[3], kv_layer.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    block_d = next_pow2(head_dim)
    splits = config.num_splits
    if splits > 1:
        part_out = torch.empty((batch, num_heads, splits, block_d), dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    relay = prefix is not None
    starts, p_out, p_lse = (prefix.kv_starts, prefix.out, prefix.lse) if relay else (seq_lens, out, out)
    prefix_splits = prefix.num_splits if relay else 1
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, kv_layer, block_tables, seq_lens, out, part_out, part_lse, starts, p_out, p_lse,
        q.stride(0), q.stride(1), kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2),
        kv_layer.stride(3), block_tables.stride(0), out.stride(0), out.stride(1),
        scale * LOG2E, num_heads, group, head_dim,
        PAGE_SIZE=block_size, NUM_SPLITS=splits, BLOCK_H=max(16, next_pow2(group)),
        BLOCK_N=config.block_n,
        BLOCK_D=block_d, UPCAST=upcast_loads(q.dtype), RELAY=relay, PREFIX_SPLITS=prefix_splits,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part_out, part_lse, seq_lens, out, starts, p_out, p_lse, out.stride(0), out.stride(1),
            num_heads, head_dim,
            NUM_SPLITS=splits, BLOCK_S=next_pow2(splits), BLOCK_N=config.block_n,
            BLOCK_D=block_d, RELAY=relay, PREFIX_SPLITS=prefix_splits,
            BLOCK_PS=next_pow2(prefix_splits), num_warps=4,
        )
    return out

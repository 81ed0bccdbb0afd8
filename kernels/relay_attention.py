"""RelayAttention decode: requests that share a prefix of KV blocks (a relay group) read it
once per step for the whole group.

Two launches a step. The prefix kernel, grid (member tiles, num_kv_heads, num_splits), takes
MEMBERS_PER_TILE members of one group times the q heads of one KV head as the M rows of
`tl.dot` ([members x next_pow2(group), head_dim]) and streams its split of the group's prefix
through the first member's block table (tokens [0, prefix_len)), with the shared tile loop;
it writes each member's normalised partial output and log-sum-exp per split. Then the paged
decode kernel reads each sequence's own keys, [prefix_len, seq_len), and folds the prefix's
partials into its output (the merge o = w * o_p + (1 - w) * o_own,
w = sigmoid(lse_p - lse_own), in float32, fused into its epilogue or its split reduction), so a
sequence with no prefix takes the plain path in the same launch.

Groups of any sizes and prefix lengths share one launch: they live in fixed-capacity buffers
(members, group_starts) whose sizes set the grid, so the launch can be captured in a CUDA
graph and replayed with other groups. Member tiles are numbered per group from
`group_starts[g] // MEMBERS_PER_TILE + g` (as prefill numbers query blocks), so
cdiv(max_members, MEMBERS_PER_TILE) + max_groups programs a KV head cover any grouping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.kernels import decode_attention
from loraplex.kernels._common import (
    cdiv,
    check_launchable,
    check_tensor,
    next_pow2,
    num_sms,
    upcast_loads,
)
from loraplex.kernels.attention_tiles import LOG2E, attend_paged_tiles, empty_state, find_segment

MAX_PREFIX_SPLITS = 8
MIN_TOKENS_PER_PREFIX_SPLIT = 256


@dataclass(frozen=True)
class RelayConfig:
    block_m: int  # q rows of a program: members_per_tile x next_pow2(group)
    block_n: int
    num_splits: int  # pieces each group's prefix is cut into
    num_warps: int
    num_stages: int


@triton.jit
def _relay_prefix_kernel(
    q_ptr, kv_ptr, block_tables_ptr, prefix_lens_ptr, members_ptr, group_starts_ptr,
    part_out_ptr, part_lse_ptr,
    stride_q_seq, stride_q_head, stride_kv_block, stride_kv_kv, stride_kv_tok, stride_kv_head,
    stride_bt_seq, scale_log2, max_groups, num_heads, group, head_dim,
    PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, MEMBERS_PER_TILE: tl.constexpr,
    GROUP_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = find_segment(group_starts_ptr, pid, max_groups, MEMBERS_PER_TILE)
    member_start = tl.load(group_starts_ptr + g)
    num_members = tl.load(group_starts_ptr + g + 1) - member_start
    tile = pid - (member_start // MEMBERS_PER_TILE + g)
    if tile * MEMBERS_PER_TILE >= num_members:
        return

    rows = tl.arange(0, MEMBERS_PER_TILE * GROUP_P2)
    t = tile * MEMBERS_PER_TILE + rows // GROUP_P2  # [BLOCK_M] member index within the group
    hg = rows % GROUP_P2
    row_valid = (t < num_members) & (hg < group)
    seq = tl.load(members_ptr + member_start + t, mask=t < num_members, other=0).to(tl.int64)
    first = tl.load(members_ptr + member_start).to(tl.int64)  # its table holds the prefix
    prefix_len = tl.load(prefix_lens_ptr + first)
    chunk = tl.cdiv(tl.cdiv(prefix_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, prefix_len)
    heads = kv_head * group + hg
    # part_out [batch, num_heads, NUM_SPLITS, BLOCK_D], part_lse [batch, num_heads, NUM_SPLITS]
    part = (seq * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_M]
    if start >= end:  # past the prefix: an empty partial
        tl.store(part_lse_ptr + part, tl.full([MEMBERS_PER_TILE * GROUP_P2], float("-inf"),
                                              tl.float32), mask=row_valid)
        return

    d = tl.arange(0, BLOCK_D)
    mask = row_valid[:, None] & (d < head_dim)[None, :]
    q = tl.load(q_ptr + seq[:, None] * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
                mask=mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    m_i, l_i, acc = empty_state(MEMBERS_PER_TILE * GROUP_P2, BLOCK_D)
    m_i, l_i, acc = attend_paged_tiles(
        q, m_i, l_i, acc, kv_ptr + kv_head * stride_kv_head, block_tables_ptr + first * stride_bt_seq,
        start, end, scale_log2, stride_kv_block, stride_kv_kv, stride_kv_tok, head_dim,
        PAGE_SIZE, BLOCK_N, BLOCK_D, UPCAST,
    )
    tl.store(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], acc / l_i[:, None], mask=mask)
    tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=row_valid)


# (block_m, block_n, num_splits, num_warps, num_stages) that the GPU tests check and
# `loraplex bench relay-kernels --sweep` times.
CANDIDATE_CONFIGS = [RelayConfig(*c) for c in (
    (64, 64, 1, 4, 3), (64, 64, 2, 4, 3), (64, 64, 4, 4, 3), (128, 64, 1, 8, 3),
    (128, 64, 2, 8, 3), (64, 32, 2, 4, 4), (32, 64, 4, 4, 3),
)]


def relay_config(max_members: int, num_kv_heads: int, group: int, max_prefix: int,
                 head_dim: int, device: torch.device) -> RelayConfig:
    """Launch config from shapes alone: 64 q rows a program (more for a wider GQA group);
    the prefix cut into as many splits as keep a full member list at no more than one
    program per SM, none shorter than MIN_TOKENS_PER_PREFIX_SPLIT tokens of the block
    table's capacity. Splits are not free: each costs every member a float32 partial
    (num_heads x head_dim) written and read, as much as 2 x group prefix tokens' KV."""
    block_m = max(64, next_pow2(group))
    programs = max(1, num_kv_heads * cdiv(max_members * next_pow2(group), block_m))
    wanted = num_sms(device) // programs
    useful = max(1, max_prefix // MIN_TOKENS_PER_PREFIX_SPLIT)
    num_splits = max(1, min(wanted, useful, MAX_PREFIX_SPLITS))
    block_n = 64 if head_dim <= 128 else 32
    return RelayConfig(block_m, block_n, num_splits, num_warps=4 if block_m <= 64 else 8,
                       num_stages=3)


def _check(q, kv_layer, block_tables, seq_lens, prefix_lens, members, group_starts) -> None:
    decode_attention._check(q, kv_layer, block_tables, seq_lens)
    check_tensor("prefix_lens", prefix_lens, ndim=1, dtypes=(torch.int32,), shape=(q.shape[0],),
                 contiguous=True)
    check_tensor("members", members, ndim=1, dtypes=(torch.int32,), contiguous=True)
    check_tensor("group_starts", group_starts, ndim=1, dtypes=(torch.int32,), contiguous=True)
    if group_starts.numel() < 2:
        raise ValueError("group_starts needs max_groups + 1 >= 2 entries, got "
                         f"{group_starts.numel()}")


def relay_decode_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    prefix_lens: torch.Tensor, members: torch.Tensor, group_starts: torch.Tensor, scale: float,
    *, num_splits: int | None = None, num_prefix_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention (one new token per sequence) where relay groups read their shared
    prefix once. q [batch, num_heads, head_dim]; kv_layer, block_tables [batch, max_blocks]
    and seq_lens [batch] (all tokens, prefix and new token included; 0 = padding) as for
    paged_decode_attention; prefix_lens [batch] int32: the tokens of the sequence's shared
    prefix (0 = in no group: the plain path); members [max_members] int32: batch rows, group g
    owning members[group_starts[g]:group_starts[g + 1]]; group_starts [max_groups + 1] int32,
    non-decreasing, unused groups empty at the end.

    Every member of a group has the group's prefix_lens; a group's prefix is tokens
    [0, prefix_len) of its first member's block table (the others' tables are not read
    there); each member's own keys are tokens [prefix_len, seq_len) of its own table. A row
    with prefix_lens > 0 must be a member of exactly one group. Returns out [batch, num_heads,
    head_dim] in q's dtype, equal to plain decode over each sequence's whole table.
    num_splits, num_prefix_splits override the split counts of the own and prefix parts."""
    _check(q, kv_layer, block_tables, seq_lens, prefix_lens, members, group_starts)
    device = check_launchable(_relay_prefix_kernel, (q, kv_layer, block_tables, seq_lens,
                                                     prefix_lens, members, group_starts))
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_layer.shape[3], kv_layer.shape[2]
    max_context = block_tables.shape[1] * block_size
    own = decode_attention.decode_config(batch, num_kv_heads, max_context, head_dim, device)
    if num_splits is not None:
        own = decode_attention.DecodeConfig(num_splits, own.block_n, own.num_warps,
                                            own.num_stages)
    config = relay_config(members.numel(), num_kv_heads, num_heads // num_kv_heads, max_context,
                          head_dim, device)
    if num_prefix_splits is not None:
        if not 1 <= num_prefix_splits <= 64:
            raise ValueError(f"num_prefix_splits must be in [1, 64], got {num_prefix_splits}")
        config = RelayConfig(config.block_m, config.block_n, num_prefix_splits, config.num_warps,
                             config.num_stages)
    return _launch(q, kv_layer, block_tables, seq_lens, prefix_lens, members, group_starts, scale,
                   own, config)


def _launch(q, kv_layer, block_tables, seq_lens, prefix_lens, members, group_starts,
            scale: float, own: decode_attention.DecodeConfig, config: RelayConfig):
    prefix = _launch_prefix(q, kv_layer, block_tables, prefix_lens, members, group_starts, scale,
                            config)
    return decode_attention._launch(q, kv_layer, block_tables, seq_lens, scale, own, prefix)


def _launch_prefix(q, kv_layer, block_tables, prefix_lens, members, group_starts, scale: float,
                   config: RelayConfig) -> decode_attention.PrefixPartials:
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_layer.shape[3], kv_layer.shape[2]
    group = num_heads // num_kv_heads
    group_p2 = next_pow2(group)
    block_d = next_pow2(head_dim)
    splits = config.num_splits
    part_out = torch.empty((batch, num_heads, splits, block_d), dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
    members_per_tile = max(1, config.block_m // group_p2)
    max_groups = group_starts.numel() - 1
    grid = (cdiv(members.numel(), members_per_tile) + max_groups, num_kv_heads, splits)
    if batch and members.numel():
        _relay_prefix_kernel[grid](
            q, kv_layer, block_tables, prefix_lens, members, group_starts, part_out, part_lse,
            q.stride(0), q.stride(1), kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2),
            kv_layer.stride(3), block_tables.stride(0), scale * LOG2E, max_groups, num_heads,
            group, head_dim,
            PAGE_SIZE=block_size, NUM_SPLITS=splits, MEMBERS_PER_TILE=members_per_tile,
            GROUP_P2=group_p2, BLOCK_N=config.block_n, BLOCK_D=block_d,
            UPCAST=upcast_loads(q.dtype), num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    return decode_attention.PrefixPartials(prefix_lens, part_out, part_lse)

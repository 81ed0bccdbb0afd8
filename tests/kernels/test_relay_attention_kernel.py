"""RelayAttention decode (kernels/relay_attention.py: the prefix kernel, the decode kernel's own
part and its fused merge) against plain attention over each sequence's concatenated KV
(prefix then own tokens, float64), and the torch reference's relay decomposition against the
same oracle. Batches mix several groups (members interleaved with rows in no group and
padding rows) in fixed-capacity group buffers with unused room, over a NaN-poisoned cache."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from loraplex.kernels import decode_attention, relay_attention
from loraplex.kernels import reference as ref
from tests.kernels.kernel_testing import (
    DEVICE,
    INTERPRETER_DTYPES,
    POISON_INT,
    cosine,
    gpu,
    guarded_1d,
    poisoned_allocations,
    rel_error,
    skip_without_cuda,
)


@dataclass
class RelayBatch:
    q: torch.Tensor  # [batch, num_heads, head_dim]
    kv_layer: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    members: torch.Tensor  # [max_members], room past the groups' members
    group_starts: torch.Tensor  # [max_groups + 1], unused groups empty
    keys: list[torch.Tensor]  # per row: its whole context's K [len, kv_heads, head_dim]
    values: list[torch.Tensor]

    def args(self):
        return (self.q, self.kv_layer, self.block_tables, self.seq_lens, self.prefix_lens,
                self.members, self.group_starts)


def make_relay_batch(groups: list[tuple[int, list[int]]], plain_lens: list[int], num_heads: int,
                     num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                     device, *, seed: int = 0, spare_members: int = 3, spare_groups: int = 2,
                     ) -> RelayBatch:
    """groups: (prefix_len, own lengths of its members); plain_lens: lengths of rows in no
    group (0 = padding). A group's whole prefix blocks are shared by its members' tables; the
    block holding a prefix's last partial block is each member's own copy (copy-on-write), so
    every member's table holds its whole context. Rows are shuffled; the cache is NaN outside
    the tokens written, table entries past a row's blocks name block 0 (NaN)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype)
    rows = []  # (group or -1, prefix K/V or None, own K/V)
    for gi, (prefix_len, own_lens) in enumerate(groups):
        prefix = rnd(prefix_len, 2, num_kv_heads, head_dim)
        rows += [(gi, prefix, rnd(n, 2, num_kv_heads, head_dim)) for n in own_lens]
    rows += [(-1, None, rnd(n, 2, num_kv_heads, head_dim)) for n in plain_lens]
    order = torch.randperm(len(rows), generator=g).tolist()
    rows = [rows[i] for i in order]

    blocks: list[torch.Tensor] = [torch.full((2, block_size, num_kv_heads, head_dim),
                                             float("nan"), dtype=dtype)]  # block 0: poison

    def new_block(tokens: torch.Tensor) -> int:  # tokens [n <= block_size, 2, kv, d]
        block = torch.full((2, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
        block[:, :len(tokens)] = tokens.transpose(0, 1)
        blocks.append(block)
        return len(blocks) - 1

    shared: dict[int, list[int]] = {}  # group -> ids of its whole prefix blocks
    tables, keys, values, seq_lens, prefix_lens = [], [], [], [], []
    for gi, prefix, own in rows:
        prefix = prefix if prefix is not None else own[:0]
        full = len(prefix) // block_size * block_size
        if gi >= 0 and gi not in shared:
            shared[gi] = [new_block(prefix[i:i + block_size]) for i in range(0, full, block_size)]
        table = list(shared.get(gi, []))
        rest = torch.cat([prefix[full:], own])
        table += [new_block(rest[i:i + block_size]) for i in range(0, len(rest), block_size)]
        tables.append(table)
        whole = torch.cat([prefix, own])
        keys.append(whole[:, 0].double())
        values.append(whole[:, 1].double())
        seq_lens.append(len(whole))
        prefix_lens.append(len(prefix) if gi >= 0 else 0)
    max_blocks = max(len(t) for t in tables) + 1
    block_tables = torch.zeros(len(rows), max_blocks, dtype=torch.int32)
    for i, table in enumerate(tables):
        block_tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
    # the block-major cache of 2 layers, this test's layer 1
    cache = torch.full((len(blocks), 2, 2, block_size, num_kv_heads, head_dim), float("nan"),
                       dtype=dtype)
    cache[:, 1] = torch.stack(blocks)

    members = []
    starts = [0]
    for gi in range(len(groups)):
        members += [r for r, (rg, _, _) in enumerate(rows) if rg == gi]
        starts.append(len(members))
    members += [POISON_INT] * spare_members
    starts += [starts[-1]] * spare_groups
    as_i32 = lambda x: guarded_1d(torch.tensor(x, dtype=torch.int32, device=device))
    q = torch.randn(len(rows), num_heads, head_dim, generator=g).to(device, dtype)
    return RelayBatch(q, cache.to(device)[:, 1], block_tables.to(device), as_i32(seq_lens),
                      as_i32(prefix_lens), as_i32(members), as_i32(starts), keys, values)


def expected_output(batch: RelayBatch, scale: float) -> torch.Tensor:
    """Plain softmax attention of each row over its concatenated K/V, float64 [batch, H, D]."""
    out = torch.zeros(batch.q.shape, dtype=torch.float64)
    num_heads = batch.q.shape[1]
    for i, (k, v) in enumerate(zip(batch.keys, batch.values)):
        if len(k) == 0:
            continue
        group = num_heads // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", batch.q[i].cpu().double(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v)
    return out.to(batch.q.device)


def run_relay(batch: RelayBatch, scale: float, **kwargs) -> torch.Tensor:
    with poisoned_allocations(relay_attention), poisoned_allocations(decode_attention):
        return relay_attention.relay_decode_attention(*batch.args(), scale, **kwargs)


def own_lengths(n: int, seed: int) -> list[int]:
    """n own lengths in 1..300 with both ends present."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 301, (n,), generator=g).tolist()
    return ([1, 300] + lens)[:n] if n > 2 else lens


TOL = {torch.float32: 2e-5, torch.float16: 3e-3}


@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("prefix_len", [0, 1, 15, 16, 17, 2047])
def test_groups_of_1_2_7_64_match_attention_over_concatenated_kv(prefix_len, gqa):
    sizes = (1, 2, 7, 64)
    groups = [(prefix_len, own_lengths(n, seed=n + gqa)) for n in sizes]
    batch = make_relay_batch(groups, [0, 40], gqa, 1, 16, 16, torch.float32, DEVICE,
                             seed=prefix_len * 10 + gqa)
    out = run_relay(batch, 0.25)
    expected = expected_output(batch, 0.25)
    assert out.dtype == torch.float32
    assert rel_error(out, expected) < TOL[torch.float32]
    padding = batch.seq_lens.cpu() == 0
    assert torch.equal(out[padding.to(out.device)], torch.zeros_like(out[padding.to(out.device)]))


MIXED = [(17, [5, 300, 1, 64, 63, 2, 129]), (16, [1, 33]), (0, [12, 7]), (2047, [1, 200, 17]),
         (1, [9]), (15, [40, 2]), (40, [0, 3])]  # a member with no own token: the prefix alone


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("num_splits,num_prefix_splits", [(None, None), (1, 1), (3, 3), (1, 4)])
def test_several_groups_in_one_batch(dtype, num_splits, num_prefix_splits):
    batch = make_relay_batch(MIXED, [0, 1, 90, 0], 8, 2, 16, 8, dtype, DEVICE, seed=3)
    out = run_relay(batch, 0.3, num_splits=num_splits, num_prefix_splits=num_prefix_splits)
    assert out.dtype == dtype
    assert rel_error(out, expected_output(batch, 0.3)) < TOL[dtype]


def test_head_dim_not_a_power_of_two_and_group_wider_than_a_tile():
    groups = [(23, [4, 30, 1]), (5, [6, 6])]
    batch = make_relay_batch(groups, [7], 20, 1, 24, 4, torch.float32, DEVICE, seed=5)
    out = run_relay(batch, 0.2, num_prefix_splits=2)
    assert rel_error(out, expected_output(batch, 0.2)) < TOL[torch.float32]


def test_no_group_is_the_plain_path_exactly():
    batch = make_relay_batch([], [0, 1, 19, 70], 8, 2, 16, 8, torch.float32, DEVICE, seed=7)
    out = run_relay(batch, 0.3, num_splits=1)
    plain = decode_attention.paged_decode_attention(batch.q, batch.kv_layer, batch.block_tables,
                                                    batch.seq_lens, 0.3, num_splits=1)
    assert torch.equal(out, plain)


def test_reference_relay_decomposition_matches_attention_over_concatenated_kv():
    batch = make_relay_batch(MIXED, [0, 1, 90], 8, 2, 16, 8, torch.float32, DEVICE, seed=9)
    out = ref.relay_decode_attention(*batch.args(), 0.3)
    expected = expected_output(batch, 0.3)
    assert rel_error(out, expected) < 1e-6
    plain = ref.paged_decode_attention(batch.q, batch.kv_layer, batch.block_tables,
                                       batch.seq_lens, 0.3)
    assert rel_error(plain, expected) < 1e-6


def test_reference_rejects_inconsistent_groups():
    batch = make_relay_batch([(16, [3, 4])], [5], 4, 1, 16, 8, torch.float32, DEVICE, seed=2)
    lens = batch.prefix_lens.clone()
    lens[lens == 0] = 3  # the row in no group now claims a prefix
    with pytest.raises(ValueError, match="no group"):
        ref.relay_decode_attention(batch.q, batch.kv_layer, batch.block_tables, batch.seq_lens,
                                   lens, batch.members, batch.group_starts, 0.3)


def test_merge_takes_an_empty_side_exactly():
    g = torch.Generator().manual_seed(0)
    o_a, o_b = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    lse = torch.randn(2, 3, generator=g) * 30
    empty = torch.full_like(lse, float("-inf"))
    assert torch.equal(ref.merge_attention_states(o_a, lse, 0 * o_b, empty)[0], o_a)
    assert torch.equal(ref.merge_attention_states(0 * o_a, empty, o_b, lse)[0], o_b)
    both, both_lse = ref.merge_attention_states(0 * o_a, empty, 0 * o_b, empty)
    assert torch.equal(both, torch.zeros_like(both)) and torch.isneginf(both_lse).all()
    merged, merged_lse = ref.merge_attention_states(o_a, lse, o_b, lse - 2.0)
    w = 1 / (1 + torch.exp(torch.tensor(-2.0)))
    torch.testing.assert_close(merged, w * o_a + (1 - w) * o_b)
    torch.testing.assert_close(merged_lse, torch.logaddexp(lse, lse - 2.0))


def test_large_logits_stay_exact():
    batch = make_relay_batch([(33, [5, 70]), (8, [1])], [20], 8, 2, 16, 8, torch.float32, DEVICE,
                             seed=11)
    batch.q.mul_(30.0)  # scores in the hundreds: the merge must not overflow
    out = run_relay(batch, 0.25, num_splits=2, num_prefix_splits=2)
    assert rel_error(out, expected_output(batch, 0.25)) < 1e-4


def test_wrapper_rejects_bad_inputs():
    batch = make_relay_batch([(16, [3, 4])], [5], 4, 1, 16, 8, torch.float32, DEVICE, seed=2)
    q, kv, tables, lens, prefix_lens, members, starts = batch.args()
    call = relay_attention.relay_decode_attention
    with pytest.raises(ValueError, match="prefix_lens"):
        call(q, kv, tables, lens, prefix_lens.long(), members, starts, 1.0)
    with pytest.raises(ValueError, match="prefix_lens"):
        call(q, kv, tables, lens, prefix_lens[:-1], members, starts, 1.0)
    with pytest.raises(ValueError, match="members"):
        call(q, kv, tables, lens, prefix_lens, members.long(), starts, 1.0)
    with pytest.raises(ValueError, match="group_starts"):
        call(q, kv, tables, lens, prefix_lens, members, starts[:1], 1.0)
    with pytest.raises(ValueError, match="num_prefix_splits"):
        call(q, kv, tables, lens, prefix_lens, members, starts, 1.0, num_prefix_splits=0)


def test_prefix_splits_are_a_function_of_shapes():
    cpu = torch.device("cpu")
    a = relay_attention.relay_config(256, 8, 4, 8192, 128, cpu)
    assert a == relay_attention.relay_config(256, 8, 4, 8192, 128, cpu)
    assert relay_attention.relay_config(1, 1, 4, 8192, 128, cpu).num_splits > 1
    assert relay_attention.relay_config(1, 1, 4, 128, 128, cpu).num_splits == 1


# ---------------------------------------------------------------- GPU, bf16


def _assert_bf16_close(out, expected):
    assert torch.isfinite(out).all()
    assert cosine(out, expected) > 0.99
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=0)


@gpu
@skip_without_cuda
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("prefix_len", [0, 1, 15, 16, 17, 2047])
def test_bf16_groups_of_1_2_7_64(prefix_len, gqa):
    groups = [(prefix_len, own_lengths(n, seed=n)) for n in (1, 2, 7, 64)]
    batch = make_relay_batch(groups, [0, 300], 8 * gqa if gqa < 8 else 32, 8 if gqa < 8 else 4,
                             128, 16, torch.bfloat16, "cuda", seed=prefix_len + gqa)
    out = run_relay(batch, 128 ** -0.5)
    _assert_bf16_close(out, expected_output(batch, 128 ** -0.5))


@gpu
@skip_without_cuda
@pytest.mark.parametrize("config", relay_attention.CANDIDATE_CONFIGS, ids=str)
@pytest.mark.parametrize("own_splits", [1, 4])
def test_bf16_candidate_configs_llama_shapes(config, own_splits):
    batch = make_relay_batch(MIXED + [(4096, own_lengths(32, 1))], [0, 2048], 32, 8, 128, 16,
                             torch.bfloat16, "cuda", seed=1)
    own = decode_attention.DecodeConfig(own_splits, 64, 4, 4)
    out = relay_attention._launch(*batch.args(), 128 ** -0.5, own, config)
    _assert_bf16_close(out, expected_output(batch, 128 ** -0.5))


@gpu
@skip_without_cuda
def test_replays_in_a_cuda_graph_with_other_groups():
    """Captured with one grouping, replayed after the group buffers were rewritten in place
    with another (same capacities): the replay equals the new grouping's eager result."""
    first = make_relay_batch([(100, [3, 9, 1]), (16, [4])], [30, 0, 12], 32, 8, 128, 16,
                             torch.bfloat16,
                             "cuda", seed=1, spare_members=4, spare_groups=2)
    second = make_relay_batch([(33, [2]), (50, [7, 8]), (1, [1, 2, 3])], [5], 32, 8, 128, 16,
                              torch.bfloat16, "cuda", seed=2, spare_members=2, spare_groups=1)
    assert first.members.numel() == second.members.numel()
    assert first.group_starts.numel() == second.group_starts.numel()
    blocks = max(first.kv_layer.shape[0], second.kv_layer.shape[0])
    width = max(first.block_tables.shape[1], second.block_tables.shape[1])
    batch_rows = first.q.shape[0]
    assert second.q.shape[0] == batch_rows
    kv = torch.zeros((blocks, 2, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
    tables = torch.zeros((batch_rows, width), dtype=torch.int32, device="cuda")
    static = [first.q.clone(), kv, tables, first.seq_lens.clone(), first.prefix_lens.clone(),
              first.members.clone(), first.group_starts.clone()]

    def load(batch):
        static[0].copy_(batch.q)
        kv.zero_()
        kv[:batch.kv_layer.shape[0]].copy_(batch.kv_layer.nan_to_num(0.0))
        tables.zero_()
        tables[:, :batch.block_tables.shape[1]].copy_(batch.block_tables)
        for dst, src in zip(static[3:], (batch.seq_lens, batch.prefix_lens, batch.members,
                                         batch.group_starts)):
            dst.copy_(src)

    call = lambda: relay_attention.relay_decode_attention(*static, 128 ** -0.5)
    load(first)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    load(second)
    eager = call()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, eager, atol=0, rtol=0)
    _assert_bf16_close(captured, expected_output(second, 128 ** -0.5))

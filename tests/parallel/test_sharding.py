"""What each tensor-parallel rank keeps (no processes)."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.lora_weights import HostAdapter
from loraplex.errors import ModelLoadError
from loraplex.model.model_config import ModelConfig
from loraplex.parallel.sharding import ShardLayout, check_tensor_parallel
from loraplex.worker.adapters import shard_host_adapter
from tests.factories import hf_config


def config(arch: str = "llama", **overrides) -> ModelConfig:
    return ModelConfig.from_dict(hf_config(arch, **overrides).to_dict())


def test_split_heads_cover_every_row_once():
    c = config(num_attention_heads=8, num_key_value_heads=4, hidden_size=64, intermediate_size=96)
    layouts = [ShardLayout(c, rank, 2) for rank in range(2)]
    assert [layout.q_range for layout in layouts] == [(0, 32), (32, 64)]  # head_dim 8, 4 heads a rank
    assert [layout.kv_range for layout in layouts] == [(0, 16), (16, 32)]
    assert [layout.intermediate_range for layout in layouts] == [(0, 48), (48, 96)]
    assert layouts[1].fused_ranges("qkv") == ((32, 64), (64 + 16, 64 + 32), (96 + 16, 96 + 32))
    assert layouts[1].fused_ranges("gate_up") == ((48, 96), (96 + 48, 192))
    shard = layouts[0].shard_config
    assert (shard.num_heads, shard.num_kv_heads, shard.intermediate_size, shard.head_dim) == (4, 2, 48, 8)
    assert shard.vocab_size == c.vocab_size  # logits come back whole


def test_fewer_kv_heads_than_ranks_are_replicated():
    c = config(num_attention_heads=8, num_key_value_heads=2, hidden_size=64)
    layouts = [ShardLayout(c, rank, 4) for rank in range(4)]
    assert {layout.num_kv_heads for layout in layouts} == {1}
    assert [layout.kv_range for layout in layouts] == [(0, 8), (0, 8), (8, 16), (8, 16)]
    # each rank's 2 query heads (16..31 on rank 1) belong to the KV head it holds: 4 queries a KV head
    assert [layout.q_range for layout in layouts] == [(0, 16), (16, 32), (32, 48), (48, 64)]


def test_vocabulary_is_padded_to_the_ranks():
    c = config(vocab_size=301)
    layouts = [ShardLayout(c, rank, 2) for rank in range(2)]
    assert [layout.vocab_rows for layout in layouts] == [151, 151]
    assert [layout.vocab_range for layout in layouts] == [(0, 151), (151, 301)]


@pytest.mark.parametrize("overrides, tp, what", [
    (dict(num_attention_heads=4, num_key_value_heads=2), 3, "4 attention heads"),
    (dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=48), 2, "3 KV heads"),
    (dict(num_attention_heads=8, num_key_value_heads=3, hidden_size=48), 4,
     "multiple of the model's 3 KV heads"),
    (dict(intermediate_size=97), 2, "intermediate size 97"),
])
def test_sizes_that_do_not_split_are_refused(overrides, tp, what):
    with pytest.raises(ModelLoadError, match=what) as caught:
        check_tensor_parallel(config(**overrides), tp)
    assert caught.value.param == "tensor_parallel_size"
    assert f"tensor_parallel_size {tp}" in str(caught.value)


def _host(c: ModelConfig, family: str) -> HostAdapter:
    """A random adapter of rank 2 on every module of `c`, laid out as make_host_adapter does."""
    q, kv, i, h, L = c.q_size, c.kv_size, c.intermediate_size, c.hidden_size, c.num_layers
    dims = {"qkv": (3, h, q + 2 * kv), "o": (1, q, h), "gate_up": (2, h, 2 * i), "down": (1, i, h)}
    a = {g: torch.randn(L, s, 2, n_in) for g, (s, n_in, _) in dims.items()}
    b = {g: torch.randn(L, out, 2) for g, (_, _, out) in dims.items()}
    ranks = {g: torch.full((L, s), 2, dtype=torch.int32) for g, (s, _, _) in dims.items()}
    return HostAdapter("digest", 2, a, b, ranks, family)


def test_adapter_shards_follow_their_base_layer():
    c = config()
    host = _host(c, "lora")
    shards = [shard_host_adapter(host, ShardLayout(c, rank, 2)) for rank in range(2)]
    # column groups: B's rows split (q, k and v each by its own heads), A whole
    q, kv = c.q_size, c.kv_size
    q_ranges, kv_ranges = [(0, q // 2), (q // 2, q)], [(0, kv // 2), (kv // 2, kv)]
    for shard, (q_lo, q_hi), (k_lo, k_hi) in zip(shards, q_ranges, kv_ranges):
        rows = torch.cat([host.b["qkv"][:, q_lo:q_hi], host.b["qkv"][:, q + k_lo:q + k_hi],
                          host.b["qkv"][:, q + kv + k_lo:q + kv + k_hi]], dim=1)
        assert torch.equal(shard.b["qkv"], rows)
        assert torch.equal(shard.a["qkv"], host.a["qkv"])
    # row groups: A's input columns split, B whole; the ranks' products sum to the whole one
    x = torch.randn(c.intermediate_size)
    whole = host.b["down"][0] @ (host.a["down"][0, 0] @ x)
    halves = [s.b["down"][0] @ (s.a["down"][0, 0] @ part) for s, part in zip(shards, x.chunk(2))]
    assert torch.allclose(halves[0] + halves[1], whole, atol=1e-5)




def test_one_rank_holds_the_adapter_whole_without_a_copy():
    c = config()
    host = _host(c, "dora")
    assert shard_host_adapter(host, ShardLayout(c, 0, 1)) is host

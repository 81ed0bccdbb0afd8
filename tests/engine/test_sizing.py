"""How big the pool that adapter slots and KV blocks share is (plan_memory), with Llama-3-8B's
shape and round budgets."""

from __future__ import annotations

import pytest
import torch

from loraplex.benchmarks import synthetic
from loraplex.engine.lora_weights import adapter_bytes, pool_slot_bytes
from loraplex.engine.sizing import kv_block_bytes, plan_memory
from loraplex.engine_config import EngineConfig
from loraplex.errors import ModelLoadError

GIB = 1 << 30
LLAMA = synthetic.model_config()


def _plan(budget: int, max_model_len: int = 8192, **options):
    config = EngineConfig.from_kwargs("m", **options)
    page = kv_block_bytes(LLAMA, config.cache.block_size, torch.bfloat16)
    slot = pool_slot_bytes(LLAMA, config.lora.max_lora_rank, torch.bfloat16, page)
    return plan_memory(config, LLAMA, torch.bfloat16, max_model_len, slot, budget), slot


def test_slot_and_block_sizes_are_the_real_ones():
    rank16 = adapter_bytes(LLAMA, 16, torch.bfloat16)
    # per layer and rank: A of q, k, v, o, gate, up (4096 wide) and down (14336); B of the outputs
    weights = 16 * 32 * (6 * 4096 + 14336 + (4096 + 2 * 1024) + 4096 + 2 * 14336 + 4096) * 2
    # and float32 vectors per layer (DoRA's row scales, IA3's): every output, o's and down's inputs
    vectors = 32 * ((4096 + 2 * 1024) + 4096 + 2 * 14336 + 4096 + 4096 + 14336) * 4
    assert rank16 == weights + vectors
    assert abs(weights / 16 - 5.24e6) < 0.01e6  # DESIGN.md: r x 5.24 MB on all seven modules
    assert kv_block_bytes(LLAMA, 16, torch.bfloat16) == 16 * 128 * 1024  # 128 KiB a token


def test_a_slot_takes_whole_pages_of_the_pool():
    page = kv_block_bytes(LLAMA, 16, torch.bfloat16)
    slot = pool_slot_bytes(LLAMA, 16, torch.bfloat16, page)
    assert slot % page == 0 and 0 <= slot - adapter_bytes(LLAMA, 16, torch.bfloat16) < page + 64 * 256


def test_the_pool_takes_a_budget_the_kv_cache_can_fill_and_slots_are_bounded_by_it():
    """No max_loras: every byte of the budget is one pool, and as many adapters fit as it holds."""
    plan, slot = _plan(50 * GIB, max_lora_rank=64)
    assert plan.num_pool_blocks == 50 * GIB // plan.kv_block_bytes
    assert plan.num_lora_slots == plan.num_pool_blocks // plan.slot_blocks - 1
    assert plan.num_kv_blocks == plan.num_pool_blocks - 2 * plan.slot_blocks
    assert plan.max_kv_blocks is None


def test_the_pool_holds_no_more_than_the_kv_cache_and_the_adapters_can_use():
    """128 requests of 656 tokens need 11 GB of KV: the pool holds that and 129 slots (slot 0
    and one a request), not the whole budget."""
    plan, slot = _plan(50 * GIB, max_model_len=656, max_num_seqs=128, max_lora_rank=16)
    assert plan.num_pool_blocks == 128 * 41 + 129 * plan.slot_blocks
    assert plan.num_lora_slots == plan.num_pool_blocks // plan.slot_blocks - 1  # while KV leaves room


def test_options_override_the_sizing():
    """num_kv_blocks is a fixed KV cache beside room for max_loras adapters; max_loras caps the slots."""
    plan, _ = _plan(50 * GIB, max_loras=7, num_kv_blocks=100)
    assert (plan.num_lora_slots, plan.num_kv_blocks, plan.max_kv_blocks) == (7, 100, 100)
    assert plan.num_pool_blocks == 100 + 8 * plan.slot_blocks


def test_too_little_memory_is_refused_with_the_options_to_change():
    """The pool must hold slot 0, one adapter of the largest rank and a KV block."""
    _, slot = _plan(GIB, max_lora_rank=64)
    with pytest.raises(ModelLoadError, match="raise gpu_memory_utilization"):
        _plan(2 * slot, max_lora_rank=64)


def test_warm_up_steps_never_hold_a_sequence_longer_than_the_context(tiny_llama):
    """A step budget far above max_model_len with few sequences: the warm-up's dummy steps spread
    their tokens over sequences no longer than the context (one 16,384-token dummy sequence with a
    320-token context and 16 sequences read past the block table and the rotary tables on the
    H100: an illegal memory access at start-up)."""
    from loraplex import LLM

    model_dir, adapters = tiny_llama
    llm = LLM(model_dir, device="cpu", dtype="float32", max_model_len=40, max_num_seqs=2,
              max_num_batched_tokens=512)
    inputs = llm.engine.runner.inputs
    assert inputs.max_seq_tokens == 40
    shapes = []
    fill_dummy = inputs.fill_dummy
    inputs.fill_dummy = lambda n, t, **kw: shapes.append((n, t)) or fill_dummy(n, t, **kw)
    assert llm.engine.runner.warm_up(512) == len(shapes) > 0
    assert all(n <= 2 and t <= 40 for n, t in shapes), shapes
    assert (2, 40) in shapes  # the budget's largest step: as many tokens as two sequences hold
    with pytest.raises(ValueError, match="does not fit"):
        fill_dummy(1, 41, adapter_slot=0, is_greedy=True, has_lora=False)

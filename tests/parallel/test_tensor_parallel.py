"""TP=2 over gloo on CPU, float32: two worker processes run the single-process engine's step
plans (adapter slot loads included) on their shards; tokens must match exactly and logits
within 1e-5, for tiny Llama, Qwen2 and Mistral models, in batches that mix the base model with
adapters of every family (LoRA, DoRA, IA3, FLoRA) and share prompt prefixes (prefix cache, relay decode)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine.lora_weights import HostAdapter, PackedAdapter
from loraplex.errors import ModelLoadError
from loraplex.worker.commands import RunnerSpec
from loraplex.worker.workers import TensorParallelWorkers, WorkerError
from tests.parallel.tp_support import SYSTEM, make_tiny_model, record, replay, runner_spec


def test_tp2_matches_one_process(tiny, tp2_workers):
    arch, model, adapters = tiny
    # 12 blocks of 16 tokens for 10 requests of 3 blocks: some are preempted and swapped out,
    # even while adapters still loading hold some of them back (20 blocks: not always)
    llm = LLM(model, device="cpu", dtype="float32", num_kv_blocks=12, swap_space=0.01,
              max_num_batched_tokens=64, max_loras=len(adapters), max_lora_rank=16, relay_attention="always")
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    recording = record(llm.engine)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    llm.generate(prompt_token_ids=[[5, 6, 7, 8, 9], [10] * 19], sampling_params=greedy)  # no adapter
    names = [None, "all8", "pattern", "ia3", "flora", "dora", "all8", None, "flora", "dora"]
    # the first 7 share a prefix (the two all8 ones form a relay group), the last 3 do not
    prompts = [SYSTEM + [100 + i] * (1 + i % 3) if i < 7 else [200 + i] * (3 + i) for i in range(len(names))]
    longer = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)  # grows past its blocks
    llm.generate(prompt_token_ids=prompts, sampling_params=longer, adapters=names)
    assert llm.engine.runner.inputs.num_relay_steps > 0  # some decode step read the shared prefix once
    assert llm.engine.scheduler.num_blocks_swapped_in > 0

    shapes = tp2_workers.load_model(runner_spec(llm.engine))
    _check_shard_shapes(llm.engine.model_config, shapes)
    steps = replay(tp2_workers, recording)
    assert len(steps) == len(recording.steps) > 10
    for want, got in zip(recording.steps, steps):
        assert got.result.sampled_ids == want.result.sampled_ids
        assert got.result.sampled_tokens == want.result.sampled_tokens, f"{arch}: step {want.plan}"
        if want.logits is not None:
            assert (got.logits - want.logits).abs().max().item() <= 1e-5


def _check_shard_shapes(config, shapes):
    hd, h, heads, kv = config.head_dim, config.hidden_size, config.num_heads, config.num_kv_heads
    kv_local, inter_local = max(kv // 2, 1), config.intermediate_size // 2
    vocab_rows = -(-config.vocab_size // 2)
    for rank_shapes in shapes:
        assert rank_shapes["layers.0.attn.qkv_weight"] == ((heads // 2 + 2 * kv_local) * hd, h)
        assert rank_shapes["layers.0.attn.o_weight"] == (h, heads // 2 * hd)
        assert rank_shapes["layers.0.mlp.gate_up_weight"] == (2 * inter_local, h)
        assert rank_shapes["layers.0.mlp.down_weight"] == (h, inter_local)
        assert rank_shapes["embed_tokens"] == (vocab_rows, h)
        assert rank_shapes["layers.0.input_norm"] == (h,)
        assert rank_shapes["kv_cache"][4:] == (kv_local, hd)
        if config.qkv_bias:
            assert rank_shapes["layers.0.attn.qkv_bias"] == ((heads // 2 + 2 * kv_local) * hd,)


def test_heads_that_do_not_split_are_refused_before_loading(tmp_path):
    make_tiny_model("llama", tmp_path, num_attention_heads=2, num_key_value_heads=1, hidden_size=32)
    refusal = "tensor_parallel_size 4 does not divide the model's 2 attention heads"
    with pytest.raises(ModelLoadError, match=refusal):
        TensorParallelWorkers.load_model(_NoWorkers(4), RunnerSpec(str(tmp_path)))


@pytest.mark.skipif(torch.cuda.device_count() >= 4, reason="needs fewer than 4 GPUs")
def test_more_ranks_than_gpus_are_refused_before_loading(tmp_path):
    make_tiny_model("llama", tmp_path)
    with pytest.raises(ModelLoadError, match="tensor_parallel_size 4 needs as many GPUs"):
        TensorParallelWorkers.load_model(_NoWorkers(4), RunnerSpec(str(tmp_path), device="cuda"))


class _NoWorkers:
    """Stands in for a group of `world_size` workers: the refusal comes before any is called."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def _call(self, command):
        raise AssertionError("a worker was called")


def test_a_failing_worker_is_reported_with_its_traceback_and_all_stopped(tp2_workers):
    pids = tp2_workers.pids
    no_slot = HostAdapter("digest", 1, {}, {}, {})
    with pytest.raises(WorkerError, match="(?s)rank [01] failed:.*(slot 999 out of range|before LoadModel)"):
        tp2_workers.load_adapter(999, no_slot)
    _check_gone(pids)
    with pytest.raises(WorkerError, match="stopped"):
        tp2_workers.execute(None)


def _check_gone(pids: list[int]) -> None:
    """Every worker stopped and reaped."""
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_dead_worker_is_reported_and_the_others_stopped(tmp_path):
    make_tiny_model("llama", tmp_path)
    workers = TensorParallelWorkers(2, timeout_s=30)
    pids = workers.pids
    try:
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerError, match="rank 1 died"):
            workers.load_model(RunnerSpec(str(tmp_path), num_kv_blocks=4))
        _check_gone(pids)
    finally:
        workers.close()


def test_pages_packed_for_another_layout_are_refused(tmp_path):
    """A load sent packed without A and B (RemoteSlots, to a worker of one rank) whose pages the
    rank cannot use fails with a message that says so, not with garbage in its slot."""
    make_tiny_model("llama", tmp_path)
    with TensorParallelWorkers(1, timeout_s=60) as workers:
        workers.load_model(RunnerSpec(str(tmp_path), num_kv_blocks=4))
        pages = PackedAdapter(torch.zeros(64, dtype=torch.uint8), {})
        light = HostAdapter("digest", 1, {}, {}, {}, packed={("another layout",): pages})
        with pytest.raises(WorkerError, match="came packed, without A and B, for another layout"):
            workers.load_adapter(1, light)

"""The engine with tensor_parallel_size=2 (two gloo worker processes on CPU, float32) against
the same engine at 1, and against transformers + PEFT (each request alone, every family PEFT
has): the same greedy tokens for tiny Llama, Qwen2 and Mistral models, with
adapters of every family (LoRA, DoRA, IA3, FLoRA) beside the base model in one batch, shared
prompt prefixes (prefix cache, relay decode) and requests preempted and swapped out and back;
the TP=2 engine schedules asynchronously (each step launched before the one before it is
collected). Bad sizes are refused before any worker starts."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine_config import ConfigError
from loraplex.errors import ModelLoadError
from tests.parallel.tp_support import SYSTEM, make_tiny_model

# 12 blocks of 16 tokens for 10 requests of 3 blocks: some are preempted and swapped out
OPTIONS = dict(device="cpu", dtype="float32", num_kv_blocks=12, swap_space=0.01, max_num_batched_tokens=64,
               max_lora_rank=16, relay_attention="always")
NAMES = [None, "all8", "pattern", "ia3", "flora", "dora", "all8", None, "flora", "dora"]
# the first 7 share a prefix (the two all8 ones form a relay group), the last 3 do not
PROMPTS = [SYSTEM + [100 + i] * (1 + i % 3) if i < 7 else [200 + i] * (3 + i) for i in range(len(NAMES))]


def _run(model, adapters, tensor_parallel_size: int, **options):
    """Every request's tokens, and the engine's stats at the end."""
    with LLM(model, tensor_parallel_size=tensor_parallel_size, max_loras=len(adapters), **OPTIONS,
             **options) as llm:
        for name, path in adapters.items():
            llm.add_adapter(name, path)
        greedy = SamplingParams(max_tokens=4, temperature=0.0)
        first = llm.generate(prompt_token_ids=[[5, 6, 7, 8, 9], [10] * 19], sampling_params=greedy)
        longer = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)  # grows past its blocks
        second = llm.generate(prompt_token_ids=PROMPTS, sampling_params=longer, adapters=NAMES)
        # the prefix cache: the shared prompts again, now cached
        third = llm.generate(prompt_token_ids=PROMPTS[:3], sampling_params=greedy, adapters=NAMES[:3])
        # seeded sampling: every rank draws the same tokens from the same all-gathered logits
        sampled = llm.generate(prompt_token_ids=PROMPTS[3:6], adapters=NAMES[3:6], sampling_params=[
            SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=i) for i in range(3)])
        return [o.token_ids for o in first + second + third + sampled], llm.engine.stats()


def test_engine_tp2_matches_tp1(tiny, reuse_tp2_workers):
    arch, model, adapters = tiny
    want, _ = _run(model, adapters, 1)
    got, stats = _run(model, adapters, 2, async_scheduling=True)
    assert got == want, arch
    _check_against_peft(model, adapters, got[2:2 + len(PROMPTS)])
    assert stats.num_relay_steps > 0  # some decode step read the shared prefix once
    assert stats.swap_bytes_out > 0 and stats.swap_bytes_in > 0
    assert stats.prefix_hit_tokens > 0
    assert stats.num_adapter_slot_loads >= len(adapters)


def _check_against_peft(model, adapters, tokens_of_batch):
    """The batch's requests whose adapters PEFT has (LoRA, DoRA, IA3, none), each against
    transformers + PEFT run alone, greedy."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    for prompt, name, tokens in zip(PROMPTS, NAMES, tokens_of_batch):
        if name == "flora":
            continue
        reference = AutoModelForCausalLM.from_pretrained(model).eval()  # PEFT mixes no families
        if name is not None:
            reference = PeftModel.from_pretrained(reference, adapters[name]).eval()
        ids = list(prompt)
        with torch.no_grad():  # greedy, eos allowed and not stopping (ignore_eos), unlike generate's
            for _ in range(len(tokens)):
                ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
        assert tokens == ids[len(prompt):], name


def test_bad_sizes_are_refused_before_the_workers_start(tmp_path):
    make_tiny_model("llama", tmp_path)  # 4 heads, 2 KV heads
    refusal = "tensor_parallel_size 3 does not divide the model's 4 attention heads"
    with pytest.raises(ModelLoadError, match=refusal):
        LLM(tmp_path, device="cpu", tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="tensor_parallel_size: must be an integer >= 1"):
        LLM(tmp_path, device="cpu", tensor_parallel_size=0)

"""The engine on CUDA with the Triton kernels and CUDA graphs, against the same engine's CPU
reference path (float32, token-exact against transformers + PEFT elsewhere)."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, SamplingParams
from tests.engine.test_hf_parity import ADAPTER_CYCLE, PROMPT_LENGTHS

pytestmark = pytest.mark.gpu


def _generate(model, adapters, device, dtype, **options):
    llm = LLM(model, device=device, dtype=dtype, block_size=16, max_num_batched_tokens=64, **options)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS * 2]
    names = [ADAPTER_CYCLE[i % len(ADAPTER_CYCLE)] for i in range(len(prompts))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, adapters=names)
    return llm, outputs


def _agreement(ours, reference, logprob_tolerance: float) -> float:
    """The share of greedy positions where `ours` gives the reference's token, compared position
    by position until the first difference (after it the contexts differ); the log-probs of the
    agreeing ones within `logprob_tolerance`."""
    agree = total = 0
    for a, b in zip(ours, reference):
        for x, y, lx, ly in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            total += 1
            if x != y:
                break
            agree += 1
            assert abs(lx.logprob - ly.logprob) < logprob_tolerance
    return agree / total


@pytest.mark.parametrize("dtype, min_agreement", [("float32", 0.9), ("bfloat16", 0.8)])
def test_triton_engine_with_graphs_matches_reference(tiny_llama, dtype, min_agreement):
    model, adapters = tiny_llama
    _, reference = _generate(model, adapters, "cpu", "float32")
    llm, ours = _generate(model, adapters, "cuda", dtype)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs._graphs, "no graph was replayed"
    assert llm.engine.model.ops.name == "triton"
    agreement = _agreement(ours, reference, 0.02 if dtype == "float32" else 0.15)
    print(f"{dtype}: {agreement:.3f} of greedy positions agree with the CPU float32 reference")
    assert agreement >= min_agreement
    assert llm.engine.blocks.num_used_blocks == 0


def test_mixed_step_graphs_match_reference(tiny_llama):
    """EngineConfig.mixed_step_graphs: steps with prompt chunks (64 tokens a step) replay their
    graphs, and the tokens agree with the CPU float32 reference as the eager steps' do."""
    model, adapters = tiny_llama
    _, reference = _generate(model, adapters, "cpu", "float32")
    llm, ours = _generate(model, adapters, "cuda", "float32", mixed_step_graphs=True)
    graphs = llm.engine.runner.graphs
    assert 64 in graphs.mixed_tokens and graphs.num_mixed_replays > 0
    assert _agreement(ours, reference, 0.02) >= 0.9
    assert llm.engine.blocks.num_used_blocks == 0


def test_seeded_sampling_on_gpu_is_reproducible(tiny_llama):
    model, adapters = tiny_llama
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, top_p=0.9, seed=5, ignore_eos=True)
    llm = LLM(model, device="cuda", dtype="bfloat16")
    first = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params)[0].token_ids
    batch = llm.generate(prompt_token_ids=[[9] * 20, [5, 6, 7], [4]], sampling_params=params)[1].token_ids
    assert first == batch


def test_overlapped_steps_give_the_same_tokens_on_gpu(tiny_llama):
    """Async scheduling (the CUDA default) feeds each decode its input token on the device,
    through the graphs' row_tokens: the same tokens and logprobs as steps run one at a time."""
    model, adapters = tiny_llama
    _, one_at_a_time = _generate(model, adapters, "cuda", "float32", async_scheduling=False)
    llm, overlapped = _generate(model, adapters, "cuda", "float32")
    assert llm.engine.async_scheduling
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in one_at_a_time]
    for a, b in zip(overlapped, one_at_a_time):
        assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-5)
    assert llm.engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_swapping_on_gpu_gives_the_tokens_of_no_preemption(tiny_llama, async_scheduling):
    """Too few KV blocks for the batch (float32, graphs on): requests are swapped out to the
    pinned host pool and back on the swap stream, ordered by events against overlapped steps,
    and give the tokens they give with room for all; nothing is recomputed, nothing leaks."""
    model, adapters = tiny_llama
    _, roomy = _generate(model, adapters, "cuda", "float32", async_scheduling=async_scheduling)
    llm, tight = _generate(model, adapters, "cuda", "float32", async_scheduling=async_scheduling,
                           num_kv_blocks=12, swap_space=0.01)
    engine = llm.engine
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    modes = {mode for _, mode in engine.scheduler.preemptions}
    assert modes == {"swap"}, engine.scheduler.preemptions
    stats = engine.stats()
    assert stats.swap_bytes_out > 0 and stats.swap_bytes_in > 0
    # The steps' waits for the copies are timed on the step stream: bounded by the whole run.
    assert 0 <= stats.swap_seconds_stalled < 60
    assert engine.scheduler.host_blocks.num_used_blocks == 0
    assert engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize("relay", ["always", "off"])
def test_relay_decode_in_graphs_matches_reference(tiny_llama, relay):
    """Groups sharing an unregistered 64-token prefix decode through the relay kernel inside the
    CUDA graphs: the same greedy tokens as the CPU float32 reference path."""
    model, adapters = tiny_llama
    generator = torch.Generator().manual_seed(11)
    prefixes = [torch.randint(3, 300, (64,), generator=generator).tolist() for _ in range(2)]
    prompts = [prefixes[i % 2] + torch.randint(3, 300, (1 + i,), generator=generator).tolist()
               for i in range(12)]
    names = [ADAPTER_CYCLE[1 + i % 2] for i in range(len(prompts))]  # one adapter a prefix
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(model, device=device, dtype="float32", block_size=16, relay_attention=relay)
        for name, path in adapters.items():
            llm.add_adapter(name, path)
        outputs[device] = llm.generate(prompt_token_ids=prompts, sampling_params=params, adapters=names)
    assert (llm.engine.runner.inputs.num_relay_steps > 0) == (relay == "always")
    agree = sum(a.token_ids == b.token_ids for a, b in zip(outputs["cuda"], outputs["cpu"]))
    assert agree >= 0.9 * len(prompts)
    assert llm.engine.blocks.num_used_blocks == 0

"""Several samples of one prompt (OpenAI's `n`): each sample after the first takes references
to the first one's full prompt blocks instead of computing them, and gives exactly the tokens
it gives alone."""

from __future__ import annotations

import pytest

from loraplex import LLM, SamplingParams
from loraplex.errors import InvalidRequestError

PROMPT = [5 + i % 40 for i in range(18)]  # 18 tokens: 4 full blocks of 4 hold prompt only


@pytest.fixture
def llm(tiny_llama):
    model, adapters = tiny_llama
    # The prefix cache off: the samples' sharing is measured, not the alone runs' cached blocks.
    llm = LLM(model, device="cpu", block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    llm.add_adapter("all8", adapters["all8"])
    llm.generate(prompt_token_ids=[[5]], adapters="all8", sampling_params=SamplingParams(max_tokens=1))
    return llm


def _params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0.9, seed=seed, ignore_eos=True)


@pytest.mark.parametrize("adapter", [None, "all8"])
def test_samples_share_the_prompt_blocks_and_match_each_sample_alone(llm, adapter):
    engine = llm.engine
    alone = [llm.generate(prompt_token_ids=[PROMPT], sampling_params=_params(seed), adapters=adapter)[0]
             for seed in range(4)]
    computed_before = engine.num_prompt_tokens
    engine.add_request("s0", prompt_token_ids=PROMPT, params=_params(0), adapter=adapter)
    for i in range(1, 4):
        engine.add_request(f"s{i}", prompt_token_ids=PROMPT, params=_params(i), adapter=adapter,
                           sample_of="s0")
    outputs, peak_blocks = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
        peak_blocks = max(peak_blocks, engine.blocks.num_used_blocks)
    assert [outputs[f"s{i}"].token_ids for i in range(4)] == [a.token_ids for a in alone]
    # The first sample computes its 18 prompt tokens, the others the 2 past the 4 shared blocks
    # (the engine counts prompt tokens but the last, which samples).
    assert engine.num_prompt_tokens - computed_before == 17 + 3 * 1
    # Blocks: 4 shared once, and each sample's own (prompt tail and output: 24 tokens -> 6 blocks).
    assert peak_blocks == 4 + 4 * 2
    assert engine.blocks.num_used_blocks == 0


def test_a_sample_waits_for_its_donor_and_survives_its_preemption(tiny_llama):
    """Blocks for less than the three samples need even with the prompt shared (6 + 2 + 2 of 9):
    samples are preempted and recomputed (shared blocks stay while any sample holds them), and
    the tokens stay the same."""
    model, _ = tiny_llama
    llm = LLM(model, device="cpu", block_size=4, num_kv_blocks=9, max_num_batched_tokens=8)
    alone = [llm.generate(prompt_token_ids=[PROMPT], sampling_params=_params(seed))[0].token_ids
             for seed in range(3)]
    engine = llm.engine
    engine.add_request("s0", prompt_token_ids=PROMPT, params=_params(0))
    engine.add_request("s1", prompt_token_ids=PROMPT, params=_params(1), sample_of="s0")
    engine.add_request("s2", prompt_token_ids=PROMPT, params=_params(2), sample_of="s0")
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output.token_ids
    assert engine.scheduler.num_preemptions > 0
    assert [outputs[f"s{i}"] for i in range(3)] == alone
    assert engine.blocks.num_used_blocks == 0


def test_a_sample_must_name_a_queued_request_of_its_prompt(llm):
    engine = llm.engine
    engine.add_request("a", prompt_token_ids=PROMPT, params=_params(0))
    with pytest.raises(InvalidRequestError, match="sample_of"):
        engine.add_request("b", prompt_token_ids=PROMPT[:-1], params=_params(1), sample_of="a")
    with pytest.raises(InvalidRequestError, match="sample_of"):
        engine.add_request("c", prompt_token_ids=PROMPT, params=_params(1), adapter="all8", sample_of="a")
    with pytest.raises(InvalidRequestError, match="sample_of"):
        engine.add_request("d", prompt_token_ids=PROMPT, params=_params(1), sample_of="nobody")
    engine.abort("a")

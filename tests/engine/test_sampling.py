"""Sampling: greedy, temperature, top-k, top-p, per-request seeds, stops and logprobs."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.kernels import reference


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(tiny_llama, request):
    model, adapters = tiny_llama
    llm = LLM(model, device="cpu", block_size=4, num_kv_blocks=40, max_num_batched_tokens=16,
              async_scheduling=request.param)
    llm.add_adapter("all8", adapters["all8"])
    return llm


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25], [30]]


def _tokens(llm, params, prompts=PROMPTS, adapters=None):
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                              adapters=adapters)]


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = _tokens(llm, seeded, prompts=[PROMPTS[0]])[0]
    in_batch = _tokens(llm, [seeded, SamplingParams(max_tokens=30, ignore_eos=True),
                             SamplingParams(max_tokens=5, seed=7)])[0]
    assert alone == in_batch
    assert _tokens(llm, seeded, prompts=[PROMPTS[0]], adapters="all8")[0] == \
        _tokens(llm, seeded, prompts=[PROMPTS[0]], adapters="all8")[0]
    other = SamplingParams(max_tokens=12, temperature=1.0, seed=4321, ignore_eos=True)
    assert _tokens(llm, other, prompts=[PROMPTS[0]])[0] != alone


def test_seeded_sampling_survives_preemption(tiny_llama):
    model, _ = tiny_llama
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=99, ignore_eos=True)
    roomy = LLM(model, device="cpu", block_size=4, max_num_batched_tokens=16)
    tight = LLM(model, device="cpu", block_size=4, num_kv_blocks=14, max_num_batched_tokens=16)
    prompts = [[5 + i] * (3 + 4 * i) for i in range(4)]
    expected = _tokens(roomy, params, prompts)
    assert _tokens(tight, params, prompts) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    overlapped = LLM(model, device="cpu", block_size=4, num_kv_blocks=14, max_num_batched_tokens=16,
                     async_scheduling=True)
    assert _tokens(overlapped, params, prompts) == expected
    assert overlapped.engine.scheduler.num_preemptions > 0


def test_filters_that_leave_one_token_are_greedy(llm):
    greedy = _tokens(llm, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    top1 = _tokens(llm, SamplingParams(max_tokens=8, temperature=1.5, top_k=1, seed=3, ignore_eos=True))
    tiny_p = _tokens(llm, SamplingParams(max_tokens=8, temperature=1.5, top_p=1e-6, seed=3, ignore_eos=True))
    assert top1 == greedy and tiny_p == greedy


def test_reference_sampler_follows_the_distribution():
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    n = 20000
    rows = logits.expand(n, -1)
    ones = torch.ones(n)

    def draw(temperature, top_k, top_p):
        tokens = reference.sample(rows, ones * temperature, torch.full((n,), top_k),
                                  ones * top_p, torch.full((n,), 5, dtype=torch.int64),
                                  torch.arange(n))
        return torch.bincount(tokens, minlength=12).float() / n

    probs = torch.softmax(logits[0] / 0.7, -1)
    assert (draw(0.7, -1, 1.0) - probs).abs().max() < 0.015
    top = probs.topk(4)
    freq = draw(0.7, 4, 1.0)
    assert freq[top.indices].sum() == 1.0
    assert (freq[top.indices] - top.values / top.values.sum()).abs().max() < 0.015
    order = probs.sort(descending=True)
    keep = int((order.values.cumsum(0) - order.values < 0.8).sum())
    freq = draw(0.7, -1, 0.8)
    assert freq[order.indices[:keep]].sum() == 1.0


def test_logprobs_are_log_softmax_of_the_model(llm):
    out = llm.generate(prompt_token_ids=[PROMPTS[0]],
                       sampling_params=SamplingParams(max_tokens=3, temperature=0.0, logprobs=5))[0]
    assert len(out.logprobs) == 3
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token
        assert max(lp.top, key=lp.top.get) == token  # greedy picks the top token
        assert lp.logprob == pytest.approx(lp.top[token])
        assert len(lp.top) == 5 and all(v <= 0 for v in lp.top.values())


def test_stop_token_ids_and_max_tokens(llm):
    free = _tokens(llm, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), [PROMPTS[0]])[0]
    stop_at = free[4]
    out = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=SamplingParams(
        max_tokens=10, temperature=0.0, stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free[:free.index(stop_at) + 1]
    out = llm.generate(prompt_token_ids=[PROMPTS[0]],
                       sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_eos_stops_unless_ignored(tiny_llama, async_scheduling):
    model, _ = tiny_llama
    llm = LLM(model, device="cpu", async_scheduling=async_scheduling)
    assert 2 in llm.engine.eos_token_ids  # config.json, tokenizer and generation_config agree
    free = _tokens(llm, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), [PROMPTS[0]])[0]
    llm.engine.eos_token_ids = frozenset({free[2]})  # pretend the model's 3rd token is its eos
    out = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=SamplingParams(
        max_tokens=10, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.token_ids == free[:free.index(free[2]) + 1]
    out = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=SamplingParams(
        max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == free

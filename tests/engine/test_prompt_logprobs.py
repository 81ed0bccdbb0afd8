"""Prompt log-probabilities against transformers + PEFT's log-softmax over the same tokens,
float32 on CPU: a batch mixing adapters (and none), requests that score only (max_tokens=0),
that score and generate, and that do not ask; whole and chunked prefill, and preemption (a
recomputed prompt is neither scored twice nor loses entries)."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine import prompt_logprobs
from tests.factories import load_peft_adapters, make_adapters, make_hf_model

TOP = 3
PROMPT_LENGTHS = (1, 2, 5, 16, 17, 33, 40, 9, 24, 3)
ADAPTER_CYCLE = (None, "qv4", "all8", "mlp16", "pattern")


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prompt-logprobs")
    hf = make_hf_model("llama", folder / "model")
    adapters = make_adapters(hf, folder / "adapters")
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    names = [ADAPTER_CYCLE[i % len(ADAPTER_CYCLE)] for i in range(len(prompts))]
    return folder / "model", adapters, prompts, names, _hf_log_softmax(hf, adapters, prompts, names)


def _hf_log_softmax(hf, adapters, prompts, names) -> list[torch.Tensor]:
    """log_softmax of transformers + PEFT's logits [len(prompt), vocab] for each prompt alone."""
    peft_model = load_peft_adapters(hf, adapters)
    references = []
    for prompt, name in zip(prompts, names):
        with torch.no_grad():
            if name is None:
                with peft_model.disable_adapter():
                    logits = peft_model(input_ids=torch.tensor([prompt])).logits[0]
            else:
                peft_model.set_adapter(name)
                logits = peft_model(input_ids=torch.tensor([prompt])).logits[0]
        references.append(torch.log_softmax(logits.float(), dim=-1))
    return references


def _params(i: int) -> SamplingParams:
    """Every third request scores only, the next scores and generates, the next only generates."""
    kind = i % 3
    return SamplingParams(max_tokens=0 if kind == 0 else 4, temperature=0.0, ignore_eos=True,
                          prompt_logprobs=None if kind == 2 else TOP)


def _run(case, **options):
    model_dir, adapters, prompts, names, _ = case
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_seqs=16, **options)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    # Adapters into their slots first, so that the batch is scheduled as one from its first step.
    llm.generate(prompt_token_ids=[[5]] * len(adapters), adapters=list(adapters),
                 sampling_params=SamplingParams(max_tokens=1))
    params = [_params(i) for i in range(len(prompts))]
    return llm, llm.generate(prompt_token_ids=prompts, sampling_params=params, adapters=names)


def _check(case, outputs):
    _, _, prompts, _, references = case
    for i, (prompt, output, reference) in enumerate(zip(prompts, outputs, references)):
        assert output.finish_reason == "length", f"request {i}"
        if i % 3 == 0:
            assert output.token_ids == [] and output.text == ""
        else:
            assert len(output.token_ids) == 4
        if i % 3 == 2:
            assert output.prompt_logprobs is None
            continue
        entries = output.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None, f"request {i}"
        for position, entry in enumerate(entries[1:], start=1):
            expected = reference[position - 1]  # [vocab]: the distribution of token `position`
            token = prompt[position]
            assert entry.token_id == token
            assert abs(entry.logprob - expected[token].item()) < 1e-4, f"request {i} position {position}"
            assert entry.rank == int((expected > expected[token]).sum()) + 1
            top_values, top_ids = expected.topk(TOP)
            assert list(entry.top) == top_ids.tolist(), f"request {i} position {position}"
            assert max(abs(v - e) for v, e in zip(entry.top.values(), top_values.tolist())) < 1e-4


def test_mixed_adapter_batch_matches_transformers_peft_whole_prefill(case):
    _, outputs = _run(case, max_num_batched_tokens=512)
    _check(case, outputs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_matches_transformers_peft(case, async_scheduling):
    llm, outputs = _run(case, max_num_batched_tokens=16, block_size=4, async_scheduling=async_scheduling)
    _check(case, outputs)
    assert llm.engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("swap_space", [0, 0.01], ids=["recompute", "swap"])
def test_preempted_requests_score_each_prompt_token_once(case, async_scheduling, swap_space, monkeypatch):
    """18 blocks of 4 tokens for 150 prompt tokens: requests are preempted part-way through
    their prompt, after some of it was scored, and recompute it from the start or swap it."""
    from loraplex.engine.scheduler import Scheduler

    scored_when_preempted = []
    preempt = Scheduler._preempt

    def recording_preempt(self, request, plan, cause):
        scored_when_preempted.append(len(request.prompt_logprobs))
        preempt(self, request, plan, cause)

    monkeypatch.setattr(Scheduler, "_preempt", recording_preempt)
    llm, outputs = _run(case, max_num_batched_tokens=16, block_size=4, num_kv_blocks=18,
                        async_scheduling=async_scheduling, swap_space=swap_space)
    mode = "swap" if swap_space else "recompute"
    assert {m for _, m in llm.engine.scheduler.preemptions} == {mode}
    assert any(n > 1 for n in scored_when_preempted), scored_when_preempted
    _check(case, outputs)
    assert llm.engine.blocks.num_used_blocks == 0


def test_slices_bound_the_logits(case, monkeypatch):
    """A tiny slice (3 rows of logits at once) gives the same figures as one slice."""
    monkeypatch.setattr(prompt_logprobs, "MAX_SLICE_ELEMENTS", 3 * 300)
    _, outputs = _run(case, max_num_batched_tokens=64)
    _check(case, outputs)


def test_scoring_only_request_without_prompt_logprobs_ends_at_once_with_nothing(case):
    model_dir, _, prompts, _, _ = case
    llm = LLM(model_dir, device="cpu", dtype="float32")
    (output,) = llm.generate(prompt_token_ids=[prompts[5]], sampling_params=SamplingParams(max_tokens=0))
    assert output.finished and output.finish_reason == "length"
    assert output.token_ids == [] and output.prompt_logprobs is None
    assert llm.engine.num_prompt_tokens == len(prompts[5])

"""The engine against Hugging Face transformers + PEFT on the same weights, float32 on CPU:
a mixed batch (adapters of different ranks and target sets, and no adapter; prompts from 1
token to several prefill chunks) gives exactly the greedy tokens each request gets alone, with
logits within 1e-4 relative. Also with chunked vs whole prefill and across preemption."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, SamplingParams
from tests.factories import generate_with_logits, load_peft_adapters, make_adapters, make_hf_model

MAX_TOKENS = 8
CHUNK = 16
PROMPT_LENGTHS = (1, 3, 7, 16, 17, 40, 2, 29, 5, 11)
ADAPTER_CYCLE = (None, "qv4", "all8", "mlp16", "pattern")


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def case(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, folder / "model")
    adapters = make_adapters(hf, folder / "adapters")
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    names = [ADAPTER_CYCLE[i % len(ADAPTER_CYCLE)] for i in range(len(prompts))]
    references = _hf_references(hf, adapters, prompts, names)
    return folder / "model", adapters, prompts, names, references


def _hf_references(hf, adapters, prompts, names):
    """(greedy tokens, logits [MAX_TOKENS, vocab]) of each request run alone."""
    peft_model = load_peft_adapters(hf, adapters)
    references = []
    for prompt, name in zip(prompts, names):
        kwargs = dict(max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                      output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        with torch.no_grad():
            if name is None:
                with peft_model.disable_adapter():
                    out = peft_model.generate(input_ids=torch.tensor([prompt]), **kwargs)
            else:
                peft_model.set_adapter(name)
                out = peft_model.generate(input_ids=torch.tensor([prompt]), **kwargs)
        tokens = out.sequences[0, len(prompt):].tolist()
        references.append((tokens, torch.cat(out.logits).float()))
    return references


def _run(model_dir, adapters, prompts, names, max_tokens=MAX_TOKENS, **options):
    llm = LLM(model_dir, device="cpu", dtype="float32", **options)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs, logits = generate_with_logits(llm, prompts, names, params)
    return llm, outputs, logits


def _check(outputs, logits, references):
    for i, (output, ours, (tokens, ref)) in enumerate(zip(outputs, logits, references)):
        assert output.token_ids == tokens, f"request {i}"
        assert output.finish_reason == "length"
        error = ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        assert error < 1e-4, f"request {i}: logits differ by {error:.2e} relative"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_batch_matches_hf_peft_chunked(case, async_scheduling):
    model_dir, adapters, prompts, names, references = case
    llm, outputs, logits = _run(model_dir, adapters, prompts, names, async_scheduling=async_scheduling,
                                max_num_batched_tokens=CHUNK, max_num_seqs=16, block_size=4)
    _check(outputs, logits, references)
    assert llm.engine.blocks.num_used_blocks == 0


def test_whole_prefill_matches_hf_peft(case):
    model_dir, adapters, prompts, names, references = case
    _, outputs, logits = _run(model_dir, adapters, prompts, names, max_num_batched_tokens=512)
    _check(outputs, logits, references)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preempted_requests_resume_with_identical_output(case, async_scheduling):
    model_dir, adapters, prompts, names, references = case
    llm, outputs, logits = _run(model_dir, adapters, prompts, names, max_num_batched_tokens=CHUNK,
                                async_scheduling=async_scheduling, block_size=4, num_kv_blocks=24,
                                max_num_seqs=16)
    assert llm.engine.scheduler.num_preemptions > 0
    _check(outputs, logits, references)
    assert llm.engine.blocks.num_used_blocks == 0


def test_fewer_slots_than_adapters_still_matches(case):
    """Two device slots for four adapters: requests wait for a slot, slots are evicted and
    reloaded between requests, and nothing mixes up."""
    model_dir, adapters, prompts, names, references = case
    llm, outputs, logits = _run(model_dir, adapters, prompts, names, max_loras=2,
                                max_num_batched_tokens=CHUNK)
    _check(outputs, logits, references)

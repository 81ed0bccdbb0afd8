"""The engine on the Triton kernels gives what it gives on the torch reference: on CPU the
kernels run through the Triton interpreter (tests/conftest.py), on a GPU compiled."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, SamplingParams


def test_triton_kernels_in_the_engine_match_the_reference(tiny_llama):
    model, adapters = tiny_llama
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = [[5, 6, 7], [8] * 20, [9], [10, 11, 12, 13, 14]]
    names = [None, "qv4", "all8", "pattern"]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=3)
    results = {}
    for kernels in ("reference", "triton"):
        llm = LLM(model, device=device, dtype="float32", kernels=kernels, max_num_batched_tokens=16,
                  enforce_eager=True)
        assert llm.engine.model.ops.name == kernels
        for name in set(names) - {None}:
            llm.add_adapter(name, adapters[name])
        results[kernels] = llm.generate(prompt_token_ids=prompts, sampling_params=params, adapters=names)
    for ours, ref in zip(results["triton"], results["reference"]):
        assert ours.token_ids == ref.token_ids
        for a, b in zip(ours.logprobs, ref.logprobs):
            assert a.top.keys() == b.top.keys()
            assert all(a.top[t] == pytest.approx(b.top[t], abs=2e-3) for t in a.top)

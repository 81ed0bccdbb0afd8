"""Attention sinks under tensor parallelism: each rank rotates back the keys of its own heads
when window blocks drop, so TP=2 streams past the window exactly as TP=1 does (float32, gloo)."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.types import StreamingWindow
from tests.factories import make_hf_model


def test_a_stream_past_its_window_is_the_same_at_tp2(tmp_path):
    make_hf_model("llama", tmp_path / "model")
    prompt = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, logprobs=0,
                            streaming_window=StreamingWindow(24, 4))  # 80 tokens through a 24-token window
    outputs = {}
    for size in (1, 2):
        with LLM(tmp_path / "model", device="cpu", dtype="float32", block_size=4,
                 tensor_parallel_size=size) as llm:
            output = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
            outputs[size] = output.token_ids, [lp.logprob for lp in output.logprobs]
            assert llm.engine.blocks.num_used_blocks == 0
    assert outputs[2][0] == outputs[1][0]
    assert outputs[2][1] == pytest.approx(outputs[1][1], abs=1e-5)

"""The padded decode path that CUDA graphs replay, run eagerly on CPU: decode steps laid out in
the step inputs at padded batch sizes give exactly the tokens of the plain path, with adapters
and seeded sampling, also when steps overlap (async scheduling: input tokens come from the
device)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.cli.engine_flags import add_engine_flags, engine_config
from loraplex.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from loraplex.engine_config import EngineConfig


def test_graph_batch_sizes():
    assert graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert graph_batch_sizes(256)[-1] == 256 and len(graph_batch_sizes(256)) == 35
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_requests", [3, 11])
def test_static_decode_path_matches_plain_path(tiny_llama, num_requests, async_scheduling):
    model, adapters = tiny_llama

    def run(static: bool, async_scheduling: bool = False):
        llm = LLM(model, device="cpu", block_size=4, max_num_seqs=20, async_scheduling=async_scheduling)
        for name, path in adapters.items():
            llm.add_adapter(name, path)
        # Adapters into their slots first, so that every request starts decoding together.
        llm.generate(prompt_token_ids=[[5]] * len(adapters), adapters=list(adapters),
                     sampling_params=SamplingParams(max_tokens=1))
        runner = llm.engine.runner
        if static:
            runner.graphs = DecodeGraphs(runner, max_batch=20, vocab_size=runner.model.config.vocab_size,
                                         capture=False)
            original, sizes = runner.forward, []

            def forward(shape, prompt=None):
                if shape.is_padded_decode:
                    sizes.append((shape.num_seqs, runner.inputs.seq_lens[:shape.num_seqs].count_nonzero()))
                return original(shape, prompt)

            runner.forward = forward
            llm.decode_sizes = sizes
        names = [None, *adapters]
        params = [SamplingParams(max_tokens=6 + i % 3, temperature=0.0 if i % 2 else 0.9, seed=i,
                                 ignore_eos=True) for i in range(num_requests)]
        outs = llm.generate(prompt_token_ids=[[5 + i] * (1 + 2 * i) for i in range(num_requests)],
                            sampling_params=params,
                            adapters=[names[i % len(names)] for i in range(num_requests)])
        return [o.token_ids for o in outs], llm

    plain, _ = run(static=False)
    static, llm = run(static=True, async_scheduling=async_scheduling)
    assert static == plain
    # the padded path ran, at graph sizes, with padding rows (sequence length 0) after the real ones
    assert len(llm.decode_sizes) >= 5
    assert all(size in graph_batch_sizes(20) and real <= size for size, real in llm.decode_sizes)
    assert max(real for _, real in llm.decode_sizes) == num_requests
    assert any(real < size for size, real in llm.decode_sizes)
    assert llm.engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_padded_mixed_steps_match_plain_path(tiny_llama, async_scheduling):
    """EngineConfig.mixed_step_graphs: steps that compute prompt chunks beside decodes, laid out
    at padded (tokens, sequences) for a graph and run eagerly on CPU, give exactly the tokens of
    the plain path, with adapters, seeded sampling and chunked prompts; padding sequences and
    sample rows come after the real ones."""
    model, adapters = tiny_llama

    def run(mixed: bool):
        llm = LLM(model, device="cpu", block_size=4, max_num_seqs=20, max_num_batched_tokens=64,
                  async_scheduling=async_scheduling)
        for name, path in adapters.items():
            llm.add_adapter(name, path)
        llm.generate(prompt_token_ids=[[5]] * len(adapters), adapters=list(adapters),
                     sampling_params=SamplingParams(max_tokens=1))
        runner, shapes = llm.engine.runner, []
        if mixed:
            runner.graphs = DecodeGraphs(runner, max_batch=20, vocab_size=runner.model.config.vocab_size,
                                         capture=False, mixed=True)
            original = runner.forward

            def forward(shape, prompt=None):
                if shape.is_padded_mixed:
                    real = int((runner.inputs.seq_lens[:shape.num_seqs] > 0).sum())
                    shapes.append((shape.num_tokens, shape.num_seqs, real))
                return original(shape, prompt)

            runner.forward = forward
        names = [None, *adapters]
        params = [SamplingParams(max_tokens=4 + i % 5, temperature=0.0 if i % 2 else 0.9, seed=i,
                                 ignore_eos=True) for i in range(12)]
        outs = llm.generate(prompt_token_ids=[[5 + i] * (3 + 7 * i) for i in range(12)],
                            sampling_params=params, adapters=[names[i % len(names)] for i in range(12)])
        return [o.token_ids for o in outs], shapes, llm

    plain, _, _ = run(mixed=False)
    padded, shapes, llm = run(mixed=True)
    assert padded == plain
    assert len(shapes) >= 3  # prompts of up to 80 tokens in steps of 64: several mixed steps
    assert all(tokens == 64 and seqs in (8, 20) and 0 < real <= seqs for tokens, seqs, real in shapes)
    assert any(real < seqs for _, seqs, real in shapes)
    assert llm.engine.blocks.num_used_blocks == 0


def test_mixed_capture_steps_store_nothing(tiny_llama):
    """The dummy steps that mixed-step graphs are captured from write no KV and take the
    prefill attention path (more than one token a sequence)."""
    model, _ = tiny_llama
    llm = LLM(model, device="cpu", block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    runner = llm.engine.runner
    runner.kv_cache.normal_()
    before = runner.kv_cache.clone()
    for seqs in (8, 7, 3):
        shape = runner.inputs.fill_dummy_mixed(64, seqs, is_greedy=seqs % 2 == 0, has_lora=True)
        assert shape.is_padded_mixed and shape.max_query_len > 1 and shape.num_samples == seqs
        assert shape.graph_key[-1] == 64
        logits, tokens, _ = runner.forward(shape)
        assert logits.shape[0] == tokens.shape[0] == seqs
    assert torch.equal(runner.kv_cache, before)


def test_mixed_padding_picks_the_smallest_graph():
    runner = SimpleNamespace(device=torch.device("cpu"), lora=SimpleNamespace(max_rank=16),
                             inputs=SimpleNamespace(max_tokens=2048))
    graphs = DecodeGraphs(runner, max_batch=128, vocab_size=8, capture=False, mixed=True)
    assert graphs.mixed_tokens == [64, 128, 256, 512, 1024] and graphs.mixed_seqs == [8, 32, 128]
    assert graphs.mixed_padding(40, 3) == (64, 8)  # 40 tokens and 5 padding sequences' tokens
    assert graphs.mixed_padding(60, 3) == (128, 8)  # 60 + 5 > 64
    assert graphs.mixed_padding(300, 33) == (512, 128)
    assert graphs.mixed_padding(1020, 3) is None  # past the largest bucket: eagerly
    assert graphs.mixed_padding(100, 129) is None
    off = DecodeGraphs(runner, max_batch=128, vocab_size=8, capture=False)
    assert off.mixed_padding(40, 3) is None
    assert EngineConfig(model="m").mixed_step_graphs  # on by default (measured on the H100)


def test_warm_up_and_memory_steps_store_nothing(tiny_llama):
    """The dummy steps run at start-up (kernel warm-up; on CUDA also the memory measurement)
    write no KV, whatever the cache held."""
    model, _ = tiny_llama
    llm = LLM(model, device="cpu", block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    runner = llm.engine.runner
    runner.kv_cache.normal_()
    before = runner.kv_cache.clone()
    assert runner.warm_up(64) == 12  # 16, 32 (16 > 8 sequences: left out), 64 and one fewer; 2 x 4
    assert torch.equal(runner.kv_cache, before)
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=3))
    assert len(out[0].token_ids) == 3


def test_flora_graphs_only_when_asked():
    """Without LoRAConfig.flora_graphs no decode graph has FLoRA rows (8 a batch size); with it,
    64 slots of max rank 16 capture 228 graphs (each batch size's FLoRA row buckets, with and
    without the LoRA expand, greedy and sampling)."""
    runner = SimpleNamespace(device=torch.device("cpu"), lora=SimpleNamespace(max_rank=16))

    def count(flora: bool) -> int:
        graphs = DecodeGraphs(runner, max_batch=64, vocab_size=8, capture=False, flora=flora)
        return 2 * sum(len(graphs.variants(size)) for size in graphs.sizes)  # greedy and not

    assert count(False) == 8 * len(graph_batch_sizes(64)) == 88
    assert count(True) == 228
    plain = DecodeGraphs(runner, max_batch=64, vocab_size=8, capture=False, flora=False)
    assert not any(v.get("flora_rows") for v in plain.variants(64))
    assert not EngineConfig(model="m").lora.flora_graphs
    assert EngineConfig.from_kwargs("m", flora_graphs=True).lora.flora_graphs
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config("m", parser.parse_args(["--flora-graphs"])).lora.flora_graphs
    assert not engine_config("m", parser.parse_args([])).lora.flora_graphs

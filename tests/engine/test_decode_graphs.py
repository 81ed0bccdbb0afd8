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

"""The static-buffer decode path that CUDA graphs replay, run eagerly on CPU: padded batch
sizes give exactly the tokens of the plain path, with adapters and seeded sampling, also when
steps overlap (async scheduling: input tokens come from the device)."""

from __future__ import annotations

import pytest

from loraplex import LLM, SamplingParams
from loraplex.engine.cuda_graphs import DecodeGraphRunner, graph_batch_sizes


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
        runner = llm.engine.runner
        if static:
            runner.graphs = DecodeGraphRunner(runner.model, runner.kv_cache, runner.lora, runner.ops,
                                              runner.row_tokens, max_batch=20,
                                              max_blocks_per_seq=runner.batch.block_table.shape[1],
                                              capture=False)
            original, sizes = runner.graphs.run, []
            runner.graphs.run = lambda inputs: sizes.append(len(inputs.input_ids)) or original(inputs)
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
    assert max(llm.decode_sizes) == num_requests and len(llm.decode_sizes) >= 5  # the static path ran
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks

"""Where a decode step's wall time goes beyond its kernels, on a GPU: the engine's full step,
the captured graph replayed and synchronised each time, and replays queued back to back (pure
GPU time). Llama-3-8B shape, random bf16 weights, batch sizes from the command line.

    python bench/decode_gaps.py [--batch-sizes 1,64] [--steps 50]"""

from __future__ import annotations

import argparse
import json
import time

import torch

from loraplex.benchmarks import decode, synthetic
from loraplex.kernels import select_ops
from loraplex.types import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    config = decode.DecodeBenchConfig(batch_sizes=tuple(sizes))
    device = torch.device("cuda")
    model_config = synthetic.model_config()
    max_len = config.prompt_len + 3 * args.steps + 64
    model = synthetic.random_model(model_config, select_ops(device), torch.bfloat16, device, max_len)
    engine = decode._engine(config, model, 1, max_len)
    graphs = engine.runner.graphs
    results = []
    for batch in sizes:
        params = SamplingParams(max_tokens=3 * args.steps + 8, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(decode._prompts(config, model_config, batch).tolist()):
            engine.add_request(f"g{batch}-{i}", prompt_token_ids=prompt, params=params)
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        step_ms = (time.perf_counter() - started) / args.steps * 1e3
        graph = graphs._graphs[(graphs.sizes[[s >= batch for s in graphs.sizes].index(True)], False, True)]
        started = time.perf_counter()
        for _ in range(args.steps):
            graph.replay()
            torch.cuda.synchronize()
        replay_sync_ms = (time.perf_counter() - started) / args.steps * 1e3
        started = time.perf_counter()
        for _ in range(args.steps):
            graph.replay()
        launch_ms = (time.perf_counter() - started) / args.steps * 1e3
        torch.cuda.synchronize()
        queued_ms = (time.perf_counter() - started) / args.steps * 1e3
        while engine.has_unfinished_requests():
            engine.step()
        row = {"batch": batch, "engine_step_ms": round(step_ms, 3),
               "replay_and_sync_ms": round(replay_sync_ms, 3), "replays_queued_ms": round(queued_ms, 3),
               "replay_launch_cpu_ms": round(launch_ms, 3)}
        print(json.dumps(row), flush=True)
        results.append(row)


if __name__ == "__main__":
    main()

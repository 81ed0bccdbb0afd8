"""Where a decode step's wall time goes beyond its kernels, on a GPU: the engine's full step,
the captured graph replayed and synchronised each time, and replays queued back to back (pure
GPU time). Llama-3-8B shape, random bf16 weights, batch sizes from the command line.

    python studies/decode_gaps.py [--batch-sizes 1,64] [--steps 50]"""

from __future__ import annotations

import argparse
import json
import time

import torch

from loraplex.benchmarks import decode, synthetic
from loraplex.engine.llm_engine import InFlight
from loraplex.kernels import select_ops
from loraplex.types import SamplingParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    config = decode.DecodeBenchConfig(batch_sizes=tuple(sizes))
    device = torch.device("cuda")
    model_config = synthetic.model_config()
    max_len = config.prompt_len + 3 * args.steps + 64
    model = synthetic.random_model(model_config, select_ops(device), torch.bfloat16, device, max_len)
    engine = decode._engine(config, model, max_len)
    graphs = engine.runner.graphs
    results = []
    for batch in sizes:
        params = SamplingParams(max_tokens=3 * args.steps + 8, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(decode._prompts(config, model_config, batch).tolist()):
            engine.add_request(f"g{batch}-{i}", prompt_token_ids=prompt, params=params)
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        phases = _time_phases(engine, 5)
        started = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        step_ms = (time.perf_counter() - started) / args.steps * 1e3
        graph = graphs._graphs[(graphs.padded_size(batch), False, True)]
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
               "replay_launch_cpu_ms": round(launch_ms, 3), "phases_ms": phases}
        print(json.dumps(row), flush=True)
        results.append(row)


def _time_phases(engine, steps: int) -> list[dict[str, float]]:
    """Milliseconds of each part of a step (schedule, runner, output processing), run one at a
    time and synchronised (no overlap)."""
    scheduler, runner = engine.scheduler, engine.runner
    engine.drain()
    rows = []
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        t1 = time.perf_counter()
        runner.apply(plan)
        filled = runner.prepare(plan)
        t2 = time.perf_counter()
        logits, tokens, _ = runner.run(filled.shape)
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        launched = runner.dispatch(plan, filled, logits, tokens)
        engine.process(InFlight(plan, scheduler.advance(plan), launched), runner.collect(launched))
        t5 = time.perf_counter()
        rows.append({k: round(v * 1e3, 3) for k, v in (
            ("schedule", t1 - t0), ("fill_and_upload", t2 - t1), ("replay", t3 - t2),
            ("gpu_wait", t4 - t3), ("results", t5 - t4))})
    return rows


if __name__ == "__main__":
    main()

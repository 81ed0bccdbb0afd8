"""The engine's own CPU time per step with many running requests: scheduling, step metadata
(the runner's input preparation) and output processing, timed apart from the model.

    python studies/engine_overhead.py [--requests 256] [--prompt 512] [--steps 200]

A tiny random Llama keeps the model's own time small; the phases timed do not depend on the
model's size. Half the requests carry one of four adapters. Writes
studies/results/engine_overhead.json."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from loraplex.benchmarks import synthetic
from loraplex.engine.llm_engine import InFlight, LLMEngine
from loraplex.engine_config import EngineConfig
from loraplex.kernels import select_ops
from loraplex.types import SamplingParams

STUDY_RESULTS = Path("studies/results")
"""Where the studies' results go (run them from the repository root)."""

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300)
NUM_ADAPTERS = 4


def build(args: argparse.Namespace) -> LLMEngine:
    max_len = args.prompt + 2048  # room for every request to decode through the whole run
    cpu = torch.device("cpu")
    config = synthetic.model_config(TINY)
    model = synthetic.random_model(config, select_ops(cpu), torch.float32, cpu, max_len, seed=0)
    engine = LLMEngine(EngineConfig.from_kwargs(
        "synthetic-tiny", device="cpu", max_model_len=max_len, max_num_seqs=args.requests,
        max_num_batched_tokens=max(2048, args.requests), max_loras=NUM_ADAPTERS, max_lora_rank=8),
        model=model)
    for i in range(NUM_ADAPTERS):
        engine.add_adapter(f"adapter-{i}", synthetic.random_adapter(
            config, 8, torch.float32, cpu, str(i), seed=i, pin=False))
    return engine


def measure(args: argparse.Namespace) -> dict:
    engine = build(args)
    params = SamplingParams(max_tokens=2047, temperature=0.8, top_p=0.95, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(f"r{i}", prompt_token_ids=[3 + i % 250] * args.prompt, params=params,
                           adapter=f"adapter-{i % NUM_ADAPTERS}" if i % 2 else None)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
            or engine.scheduler.num_waiting:
        engine.step()
    schedule, prepare, postprocess, model = [], [], [], []
    runner, scheduler = engine.runner, engine.scheduler
    for _ in range(args.steps):
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        t1 = time.perf_counter()
        runner.apply(plan)
        filled = runner.prepare(plan)
        t2 = time.perf_counter()
        launched = runner.dispatch(plan, filled, *runner.run(filled.shape))
        step = InFlight(plan, scheduler.advance(plan), launched)
        result = runner.collect(launched)
        t3 = time.perf_counter()
        engine.process(step, result)
        t4 = time.perf_counter()
        assert len(plan.request_ids) == args.requests and plan.num_tokens == args.requests
        schedule.append(t1 - t0)
        prepare.append(t2 - t1)
        model.append(t3 - t2)
        postprocess.append(t4 - t3)

    def us(values: list[float]) -> float:
        return round(statistics.median(values) * 1e6, 1)

    return {
        "running_requests": args.requests, "prompt_tokens": args.prompt, "steps": args.steps,
        "schedule_us": us(schedule), "prepare_us": us(prepare),
        "engine_us (schedule + prepare)": round(us(schedule) + us(prepare), 1),
        "postprocess_us (update, stops, detokenize)": us(postprocess),
        "model_and_sampling_us (not engine overhead)": us(model),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    figures = measure(args)
    for key, value in figures.items():
        print(f"{key:45s} {value}")
    out = STUDY_RESULTS / "engine_overhead.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Where a step that carries a prompt chunk beside decodes spends its time (the steps that
serving under Poisson arrivals runs almost only): Llama-3-8B shape, random bf16 weights, 64
rank-16 adapters resident. Runs RUNNING decodes, then adds one PROMPT-token request per step for
STEPS steps; prints the mean wall time of pure decode steps and of mixed steps, the GPU time of
the mixed steps' kernels (torch.profiler), and cProfile's top functions by own time over the
mixed steps (host time the GPU waits for). On the CPU (`--cpu`) a tiny shape checks the script.

    python3 scripts/profile-mixed-steps.py [--running 32] [--prompt 256] [--steps 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch

from loraplex.benchmarks import synthetic
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine_config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from loraplex.kernels import engine_ops
from loraplex.types import SamplingParams

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1000}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--running", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--adapters", type=int, default=64)
    parser.add_argument("--no-adapters", action="store_true")
    parser.add_argument("--mixed-graphs", action="store_true", help="EngineConfig.mixed_step_graphs")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    config = synthetic.model_config(TINY if args.cpu else None)
    max_len = 2048
    model = synthetic.random_model(config, engine_ops(device), dtype, device, max_len, seed=0)
    engine = LLMEngine(EngineConfig(
        model="synthetic-llama-3-8b", device=device.type, dtype=str(dtype).removeprefix("torch."),
        max_model_len=max_len, mixed_step_graphs=args.mixed_graphs,
        cache=CacheConfig(block_size=16, num_kv_blocks=4096 if not args.cpu else 512),
        scheduler=SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=2048,
                                  scheduler_delay_factor=0.0),  # every step here takes its prompt
        lora=LoRAConfig(max_lora_rank=16)), model=model)
    names = [f"a{i}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        engine.add_adapter(name, synthetic.random_adapter(config, 16, dtype, device, name, seed=100 + i,
                                                          pin=device.type == "cuda"))
    gen = torch.Generator().manual_seed(0)
    counter = iter(range(10**9))

    def add(prompt_len: int, max_tokens: int) -> None:
        i = next(counter)
        tokens = torch.randint(100, config.vocab_size - 100, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"r{i}", prompt_token_ids=tokens,
                           params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           adapter=None if args.no_adapters else names[i % len(names)])

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.running):
        add(args.prompt, 10**4 // 4)
    while len(engine.scheduler.running) < args.running or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    sync()
    started = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    decode_ms = (time.perf_counter() - started) / args.steps * 1e3

    def mixed(n: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            add(args.prompt, 2)
            engine.step()
        sync()
        return (time.perf_counter() - t0) / n * 1e3

    mixed(3)  # warm
    mixed_ms = mixed(args.steps)
    profiler = cProfile.Profile()
    profiler.enable()
    mixed(args.steps)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(45)
    pstats.Stats(profiler, stream=text).sort_stats("cumtime").print_stats(45)
    gpu_ms = None
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            mixed(args.steps)
        events = prof.key_averages()
        gpu_ms = sum(getattr(e, "self_device_time_total", 0) for e in events) / args.steps / 1e3
        text.write(events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70))
    summary = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "mixed_step_graphs": args.mixed_graphs,
               "running": args.running, "prompt": args.prompt,
               "adapters": 0 if args.no_adapters else args.adapters,
               "decode_step_ms": round(decode_ms, 3), "mixed_step_ms": round(mixed_ms, 3),
               "mixed_step_gpu_ms": None if gpu_ms is None else round(gpu_ms, 3)}
    print(json.dumps(summary))
    tag = ("none" if args.no_adapters else "lora") + ("-mixed-graphs" if args.mixed_graphs else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"mixed-steps-{tag}.txt").write_text(json.dumps(summary) + "\n" + text.getvalue())
    print(text.getvalue()[:6000])


if __name__ == "__main__":
    main()

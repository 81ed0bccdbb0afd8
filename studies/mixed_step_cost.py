"""What does a step that computes prompt tokens beside decode rows cost, and does chunking a
prompt cost more than its tokens? (issue 29: VTC's prompt-chunk cap of 1,024 tokens cost the
H100 15% of the fairness benchmark's throughput where the step-time model that the fairness
simulation uses, 6.8 ms + 0.062 ms a decode row + 0.030 ms a prompt token, predicts 0.3%.)

On the fairness benchmark's engine (Llama-3-8B shape, bf16, 4,096 KV blocks, four rank-16
adapters), with DECODERS requests decoding, one new prompt of L tokens is computed in chunks of
C tokens (the step budget set to C + DECODERS); the time from adding it to its first token over
the steps it took gives the mixed step's cost, against a decode-only step. Prints one JSON line
per case and writes them all to --out.

    python studies/mixed_step_cost.py [--device cuda] [--out studies/results/mixed-step-cost.json]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from loraplex.benchmarks import synthetic
from loraplex.benchmarks.fairness_workload import TENANTS
from loraplex.benchmarks.serve_workload import FIRST_TOKEN
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine_config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from loraplex.kernels import select_ops
from loraplex.types import SamplingParams

CASES = ((2048, 2048), (2048, 1024), (4096, 4096), (4096, 1024), (8192, 8192), (8192, 2048), (8192, 1024))
"""(prompt tokens, chunk tokens)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--decoders", type=int, default=48)
    parser.add_argument("--model-overrides", type=json.loads, default=None)
    parser.add_argument("--scale", type=int, default=1, help="divide the cases' token counts by this")
    parser.add_argument("--out", type=Path, default=Path("studies/results/mixed-step-cost.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_config = synthetic.model_config(args.model_overrides)
    max_len = 8192 // args.scale + 2048
    model = synthetic.random_model(model_config, select_ops(device), dtype, device, max_len, seed=0)
    engine = LLMEngine(EngineConfig(
        model="synthetic-llama-3-8b", device=args.device, dtype=str(dtype).removeprefix("torch."),
        max_model_len=max_len, cache=CacheConfig(block_size=16, swap_space=1, num_kv_blocks=4096),
        scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192 // args.scale + 256),
        lora=LoRAConfig(max_lora_rank=16, max_loras=len(TENANTS))), model=model)
    for i, tenant in enumerate(TENANTS):
        engine.add_adapter(tenant, synthetic.random_adapter(model_config, 16, dtype, device, tenant,
                                                            seed=100 + i, pin=device.type == "cuda"))
    rng = np.random.default_rng(0)
    full = engine.scheduler.config
    results = []
    for repeat in range(2):
        for prompt_len, chunk in ((0, 0),) + CASES:
            prompt_len, chunk = prompt_len // args.scale, chunk // args.scale
            engine.scheduler.config = full
            params = SamplingParams(max_tokens=4000, ignore_eos=True, temperature=0.0)
            ids = [f"d{repeat}-{prompt_len}-{chunk}-{i}" for i in range(args.decoders)]
            for i, request_id in enumerate(ids):
                prompt = rng.integers(FIRST_TOKEN, model_config.vocab_size, 512 // args.scale).tolist()
                engine.add_request(request_id, prompt_token_ids=prompt, params=params,
                                   adapter=TENANTS[i % len(TENANTS)], tenant=TENANTS[i % len(TENANTS)])
            started: set[str] = set()
            while len(started) < len(ids):
                started.update(o.request_id for o in engine.step())
            for _ in range(5):
                engine.step()
            _sync(device)
            row = {"decoders": args.decoders, "prompt_tokens": prompt_len, "chunk": chunk}
            if prompt_len == 0:
                begin = time.perf_counter()
                for _ in range(20):
                    engine.step()
                _sync(device)
                row["decode_step_ms"] = round((time.perf_counter() - begin) / 20 * 1e3, 3)
            else:
                engine.scheduler.config = replace(full, max_num_batched_tokens=chunk + args.decoders)
                prompt = rng.integers(FIRST_TOKEN, model_config.vocab_size, prompt_len).tolist()
                begin = time.perf_counter()
                engine.add_request("new", prompt_token_ids=prompt, params=SamplingParams(max_tokens=1),
                                   adapter=TENANTS[0], tenant=TENANTS[0])
                steps = 0
                done = False
                while not done:
                    steps += 1
                    done = any(o.request_id == "new" for o in engine.step())
                _sync(device)
                took = time.perf_counter() - begin
                row.update(steps=steps, to_first_token_ms=round(took * 1e3, 2),
                           mixed_step_ms=round(took / steps * 1e3, 2))
            for request_id in ids:
                engine.abort(request_id)
            engine.drain()
            while engine.has_unfinished_requests():
                engine.step()
            if repeat == 1:
                results.append(row)
                print(json.dumps(row), flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": name, "rows": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""`loraplex bench tensor-parallel`: the engine at tensor_parallel_size 1 against 2 (or more) on a
Llama-3-8B-shaped model with random weights: the batch-1 decode step (issue 22's goal: TP=2 at
<= 0.6x the TP=1 step) and batch-64 decode with one rank-16 adapter per request (goal: >= 1.7x
the TP=1 throughput), and the time that a step's collectives take on their own: two
all-reduces of [batch, hidden] a layer and one for the embedding, and the all-gather of the
float32 logits, timed apart by the same workers (on CUDA in one graph, as a decode step
replays them; `step_ms` is the same collectives launched one by one). On a CPU with gloo the same
runs on a tiny model (`--model '{...}'`) as a smoke test."""

from __future__ import annotations

import argparse
import gc
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from loraplex.benchmarks import synthetic
from loraplex.benchmarks.results import RESULTS, write
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine_config import EngineConfig
from loraplex.kernels import engine_ops
from loraplex.model.model_config import ModelConfig
from loraplex.types import SamplingParams

GOALS = {"batch1_step_ratio_max": 0.6, "batch64_throughput_ratio_min": 1.7}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model_config = synthetic.model_config(args.model)
    max_len = args.prompt_len + args.new_tokens + 16
    rows, collectives = [], []
    with tempfile.TemporaryDirectory(prefix="loraplex-tp-bench-") as folder:
        (Path(folder) / "config.json").write_text(json.dumps({**synthetic.LLAMA3_8B, **args.model}))
        for size in args.tensor_parallel_sizes:
            size_rows, size_collectives = _run_engine(args, folder, model_config, size, device, dtype,
                                                      max_len)
            rows += size_rows
            collectives += size_collectives
    return {"benchmark": "tensor-parallel", "config": vars(args) | {"out": str(args.out)},
            "device": _device_name(device), "devices": _device_names(device, max(args.tensor_parallel_sizes)),
            "torch": torch.__version__, "rows": rows, "collectives": collectives,
            "summary": summarize(rows, collectives), "goals": GOALS,
            "cuda_graphs": device.type == "cuda" and not args.enforce_eager}


def _run_engine(args: argparse.Namespace, folder: str, model_config: ModelConfig, size: int,
                device: torch.device, dtype: torch.dtype, max_len: int
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    config = EngineConfig.from_kwargs(
        folder, device=device.type, dtype=args.dtype, max_model_len=max_len, tensor_parallel_size=size,
        max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=max(2048, args.prompt_len),
        max_lora_rank=args.rank, enforce_eager=args.enforce_eager, enable_prefix_caching=False)
    started, model = time.perf_counter(), None
    if size == 1:
        ops = engine_ops(device)
        model = synthetic.random_model(model_config, ops, dtype, device, max_len, seed=args.seed)
        engine = LLMEngine(config, model=model)
    else:
        engine = LLMEngine(config, random_weights=True)
    build_s = time.perf_counter() - started
    print(f"TP={size}: engine built in {build_s:.1f} s; {engine.memory.describe()}", flush=True)
    names = []
    for i in range(max(args.batch_sizes)):
        host = synthetic.random_adapter(model_config, args.rank, dtype, torch.device("cpu"), str(i),
                                        seed=1000 + i, pin=False)
        engine.add_adapter(f"adapter-{i}", host)
        names.append(f"adapter-{i}")
    rows = []
    try:
        for batch in args.batch_sizes:
            for with_adapters in (False, True):
                _decode(engine, args, model_config, 2, with_adapters, names, "warm")  # compiles, loads
                rows.append(_decode(engine, args, model_config, batch, with_adapters, names, "timed")
                            | {"tensor_parallel_size": size, "build_s": round(build_s, 1)})
                print(json.dumps(rows[-1]), flush=True)
        collectives = []
        if engine.executor is not None:  # the step's collectives on their own, in the same group
            collectives = [row | {"tensor_parallel_size": size}
                           for row in engine.executor.workers.time_collectives(args.batch_sizes)]
            print(json.dumps(collectives), flush=True)
    finally:
        engine.close()
        del engine, model
        gc.collect()  # the TP=1 model and pool leave GPU 0 before the workers size their pools
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, collectives


def _decode(engine: LLMEngine, args: argparse.Namespace, model_config: ModelConfig, batch: int,
            with_adapters: bool, names: list[str], tag: str) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(args.seed + batch)
    prompts = torch.randint(100, model_config.vocab_size - 100, (batch, args.prompt_len), generator=generator)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts.tolist()):
        engine.add_request(f"{tag}-{batch}-{with_adapters}-{i}", prompt_token_ids=prompt, params=params,
                           adapter=names[i % len(names)] if with_adapters else None)
    started, decode_start, seen = time.perf_counter(), None, set()
    while engine.has_unfinished_requests():
        seen.update(o.request_id for o in engine.step())
        if decode_start is None and len(seen) == batch:
            decode_start = time.perf_counter()  # every prompt is done; decode steps follow
    ended = time.perf_counter()
    step_s = (ended - decode_start) / max(args.new_tokens - 1, 1)
    return {"batch": batch, "adapters": batch if with_adapters else 0, "step_ms": round(step_s * 1e3, 3),
            "decode_tok_s": round(batch / step_s, 1), "prefill_s": round(decode_start - started, 3)}


def summarize(rows: list[dict[str, Any]], collectives: list[dict[str, Any]]) -> dict[str, Any]:
    """Each TP size against TP=1: the batch-1 step (no adapters) and batch-64 throughput (64
    adapters), as ratios, with the collectives' time per step."""
    def find(size: int, batch: int, adapters: bool) -> dict[str, Any] | None:
        return next((r for r in rows if r["tensor_parallel_size"] == size and r["batch"] == batch
                     and bool(r["adapters"]) == adapters), None)

    summary = {}
    for size in sorted({r["tensor_parallel_size"] for r in rows} - {1}):
        entry: dict[str, Any] = {}
        one, many = find(size, 1, False), find(size, max(r["batch"] for r in rows), True)
        base_one, base_many = find(1, 1, False), find(1, many["batch"] if many else 0, True)
        if one and base_one:
            entry["batch1_step_ratio"] = round(one["step_ms"] / base_one["step_ms"], 3)
        if many and base_many:
            entry[f"batch{many['batch']}_throughput_ratio"] = round(
                many["decode_tok_s"] / base_many["decode_tok_s"], 3)
        entry["collective_ms_per_step"] = {c["batch"]: c.get("graph_step_ms", c["step_ms"])
                                           for c in collectives if c["tensor_parallel_size"] == size}
        summary[f"tp{size}"] = entry
    return summary


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def _device_names(device: torch.device, count: int) -> list[str]:
    if device.type != "cuda":
        return [_device_name(device)] * count
    return [torch.cuda.get_device_name(i) for i in range(min(count, torch.cuda.device_count()))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="loraplex bench tensor-parallel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor-parallel-sizes", type=_ints, default=[1, 2])
    parser.add_argument("--batch-sizes", type=_ints, default=[1, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16, help="rank of every adapter (all seven projections)")
    parser.add_argument("--model", type=json.loads, default={},
                        help="config.json overrides of the Llama-3-8B shape, as JSON (a tiny model on CPU)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result = run(args)
    path = write(result, args.out, "tensor-parallel")
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {path}")


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


if __name__ == "__main__":
    main()

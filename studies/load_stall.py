"""How much of an adapter's host load stalls the engine's thread, and which part of the load does
it (issue 27: the serving simulation puts ~60 ms of each ~100 ms host load on the engine's loop).

An engine-like thread runs steps back to back (a little Python, as the scheduler's, then a chain
of matrix products on the device, waited for), while a loader thread runs one part of a host
load over and over on a Llama-3-8B-shaped rank-16 adapter on all seven projections. The engine
time lost per load is the loads' wall time beyond what the steps completed in it take alone
(their median alone, each). Parts:

- synthetic: the serving pass's loader (a pinned copy of a pool adapter: synthetic_server);
- pack: LoraSlotBuffers.prepare, the adapter laid out as the pool's pages (every load does it);
- registry: the server's loader from a PEFT safetensors file (read, validate, make_host_adapter);
- pin-cached / pin-fresh: a pinned buffer of the packed size from torch's host cache / new.

    python studies/load_stall.py [--device cuda] [--loads 8] [--out studies/results/X.json]"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from loraplex.adapter_format import load_adapter
from loraplex.benchmarks import synthetic
from loraplex.benchmarks.serve_bench import random_peft_adapter
from loraplex.engine.lora_weights import HostAdapter, LoraSlotBuffers, make_host_adapter


class EngineLoop(threading.Thread):
    """Steps back to back until stopped; each step's wall time and when it ended."""

    def __init__(self, device: torch.device, size: int, depth: int) -> None:
        super().__init__(name="engine", daemon=True)
        self.device, self.stop = device, threading.Event()
        self.x = torch.randn(size, size, device=device, dtype=torch.bfloat16 if device.type == "cuda"
                             else torch.float32)
        self.depth = depth
        self.steps: list[tuple[float, float]] = []  # (end time, step seconds)

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.perf_counter()
            plan = sorted(range(3000), key=lambda i: -i)  # the scheduler's Python, ~0.3 ms
            y = self.x
            for _ in range(self.depth):
                y = y @ self.x
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            del plan, y
            ended = time.perf_counter()
            self.steps.append((ended, ended - started))


def measure(engine: EngineLoop, part: Callable[[], object], num_loads: int, base_s: float) -> dict:
    """Run `part` num_loads times on this (the loader's) thread while the engine steps."""
    first = len(engine.steps)
    started, cpu = time.perf_counter(), time.thread_time()
    for _ in range(num_loads):
        part()
    wall, cpu = time.perf_counter() - started, time.thread_time() - cpu
    ended = time.perf_counter()
    during = [s for end, s in engine.steps[first:] if end <= ended]
    # The window's time beyond what its steps would have taken alone (a step stalled past the
    # window's end counts too: a part that stops every step shows as its whole length).
    lost = max(0.0, (ended - started) - len(during) * base_s)
    return {"load_ms": round(1e3 * wall / num_loads, 2), "load_cpu_ms": round(1e3 * cpu / num_loads, 2),
            "steps": len(during),
            "step_p50_ms": round(1e3 * statistics.median(during), 3) if during else None,
            "step_max_ms": round(1e3 * max(during), 3) if during else None,
            "engine_lost_ms_per_load": round(1e3 * lost / num_loads, 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--loads", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--layers", type=int, default=32, help="fewer for a quick CPU check")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    is_cuda = device.type == "cuda"
    dtype = torch.bfloat16 if is_cuda else torch.float32
    torch.set_num_threads(1)
    config = synthetic.model_config({"num_hidden_layers": args.layers})
    buffers = LoraSlotBuffers(config, 4, args.rank, dtype, device)
    source = synthetic.random_adapter(config, args.rank, dtype, device, "s", 0, pin=is_cuda)

    def synthetic_load() -> HostAdapter:
        def copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {g: torch.empty_like(t, pin_memory=t.is_pinned()).copy_(t) for g, t in tensors.items()}
        return HostAdapter("x", source.rank, copy(source.a), copy(source.b), copy(source.ranks))

    def pack() -> None:
        source.packed.clear()
        buffers.prepare(source)

    folder = Path(tempfile.mkdtemp())
    config_json, weights = random_peft_adapter(dataclasses.asdict(config.shape), args.rank, 0)
    (folder / "adapter_model.safetensors").write_bytes(weights)

    def registry_load() -> None:
        adapter = load_adapter(config_json, folder / "adapter_model.safetensors", config.shape, args.rank)
        buffers.prepare(make_host_adapter(adapter, config, dtype, pin=is_cuda))

    packed_bytes = len(buffers.prepare(source).pages)
    kept: list[torch.Tensor] = []

    def pin_cached() -> None:
        torch.empty(packed_bytes, dtype=torch.uint8, pin_memory=is_cuda)

    def pin_fresh() -> None:  # kept alive, so torch's host cache has none free to give
        kept.append(torch.empty(packed_bytes + 4096 * len(kept), dtype=torch.uint8, pin_memory=is_cuda))

    engine = EngineLoop(device, 4096 if is_cuda else 256, 40 if is_cuda else 4)
    engine.start()
    time.sleep(1.0)
    first = len(engine.steps)
    time.sleep(2.0)
    base = [s for _, s in engine.steps[first:]]
    base_s = statistics.median(base)
    parts = {"synthetic": synthetic_load, "pack": pack, "synthetic+pack": lambda: (synthetic_load(), pack()),
             "registry": registry_load, "pin-cached": pin_cached, "pin-fresh": pin_fresh}
    results = {"device": torch.cuda.get_device_name(device) if is_cuda else "cpu",
               "adapter_bytes": source.num_bytes, "packed_bytes": packed_bytes,
               "step_alone_p50_ms": round(1e3 * base_s, 3), "step_alone_max_ms": round(1e3 * max(base), 3),
               "parts": {}}
    for name, part in parts.items():
        part()  # once first: plans made, caches warm
        results["parts"][name] = measure(engine, part, args.loads, base_s)
        print(name, results["parts"][name], flush=True)
        time.sleep(0.3)
    engine.stop.set()
    engine.join()
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

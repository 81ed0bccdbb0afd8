"""How long a worker process takes to load an adapter into a slot (a Llama-3-8B shape, rank 16,
all seven projections: 84 MB in bf16), by how the driver holds the adapter: a fresh pinned copy
each time (what the synthetic adapters' loader hands the engine), the same tensors again,
tensors in shared memory; packed on the driver as the worker's pool pages, in shared memory,
sent without A and B (`RemoteSlots.prepare` on the adapter cache's load thread; the packing
timed apart, off the load); and those pages written into the worker's adapter ring, pinned
there on a GPU (the write, which the adapter cache's copy thread makes, timed apart). The
command's pickling through the worker's pipe was the suspect of the prefill side's slowness in
`loraplex bench disaggregated` (issue 23). One GPU:

    OUT=/tmp python studies/adapter_load_workers.py

Without a GPU it runs a tiny shape, or with LAYERS=N the Llama-3-8B shape cut to N layers (an
adapter of N x 2.6 MB), to time the host's part of a load."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from loraplex.benchmarks import synthetic
from loraplex.engine.lora_weights import HostAdapter, LoraSlotBuffers
from loraplex.worker.adapters import packed_for_the_wire
from loraplex.worker.commands import RunnerSpec
from loraplex.worker.workers import TensorParallelWorkers


def _copy(host: HostAdapter, pin: bool) -> HostAdapter:
    def copy(tensors):
        return {g: torch.empty_like(t, pin_memory=pin).copy_(t) for g, t in tensors.items()}

    return HostAdapter(host.digest, host.rank, copy(host.a), copy(host.b), copy(host.ranks))


def main() -> None:
    out = Path(os.environ.get("OUT", "."))
    cuda = torch.cuda.is_available()  # (without a GPU: a tiny shape, to try the script)
    layers = os.environ.get("LAYERS")
    overrides = {} if cuda else {"num_hidden_layers": int(layers)} if layers else {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
    folder = tempfile.mkdtemp()
    (Path(folder) / "config.json").write_text(json.dumps({**synthetic.LLAMA3_8B, **overrides}))
    config = synthetic.model_config(overrides)
    device = torch.device("cuda" if cuda else "cpu")
    result = {"device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    with TensorParallelWorkers(1, backend="nccl" if cuda else "gloo", num_threads=8) as workers:
        spec = RunnerSpec(model=folder, dtype="bfloat16", device=device.type, max_model_len=4096,
                          num_kv_blocks=256, block_size=16, num_lora_slots=4, max_lora_rank=16,
                          max_num_seqs=8, max_num_batched_tokens=2048, random_weights=True)
        started = time.perf_counter()
        workers.load_model(spec)
        result["load_model_s"] = round(time.perf_counter() - started, 2)
        base = synthetic.random_adapter(config, 16, torch.bfloat16, device, "x", seed=1, pin=cuda)
        result["adapter_mb"] = round(sum(t.numel() * t.element_size() for d in (base.a, base.b)
                                         for t in d.values()) / 1e6, 1)
        shared = _copy(base, pin=False)
        for tensors in (shared.a, shared.b, shared.ranks):
            for t in tensors.values():
                t.share_memory_()
        packer = LoraSlotBuffers(config, 0, 16, torch.bfloat16, torch.device("cpu"))
        packing: list[float] = []

        def packed() -> HostAdapter:
            host = _copy(base, pin=False)
            started = time.perf_counter()
            pages = packer.prepare(host)
            pages.pages.share_memory_()
            packing.append(time.perf_counter() - started)
            return packed_for_the_wire(host, packer.pack_key)

        ring = torch.zeros(2 * packer.prepare(_copy(base, pin=False)).pages.numel(), dtype=torch.uint8)
        workers.map_adapter_ring(ring.share_memory_())
        ring_writes: list[float] = []

        def through_the_ring() -> HostAdapter:
            host = _copy(base, pin=False)
            pages = packer.prepare(host).pages
            started = time.perf_counter()
            ring[:pages.numel()].copy_(pages)
            ring_writes.append(time.perf_counter() - started)
            return packed_for_the_wire(host, packer.pack_key, pages_in_ring=True)

        kinds = {"fresh pinned copy": lambda: _copy(base, pin=cuda), "the same pinned tensors": lambda: base,
                 "shared memory": lambda: shared, "packed on the driver": packed,
                 "through the adapter ring": through_the_ring}
        for kind, make in kinds.items():
            times = []
            for i in range(6):
                host = make()
                in_ring = kind == "through the adapter ring"
                started = time.perf_counter()
                workers.load_adapter(1 + i % 4, host, ring=(0, len(ring) // 2) if in_ring else None)
                times.append(time.perf_counter() - started)
            result[kind] = {"ms": [round(t * 1000, 1) for t in times],
                            "median_ms": round(statistics.median(times) * 1000, 1)}
            print(kind, result[kind], flush=True)
        for name, times in (("driver packing (off the load)", packing),
                            ("ring write (the driver's copy thread)", ring_writes)):
            result[name] = {"ms": [round(t * 1000, 1) for t in times],
                            "median_ms": round(statistics.median(times) * 1000, 1)}
    (out / "adapter-load-workers.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()

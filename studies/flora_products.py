"""FLoRA's base products at Llama-3-8B shapes (bf16, cuBLAS, GPU only): one layer's products
with the rows each layout gives them, replayed from a CUDA graph over 8 layers of distinct
weights (past the 50 MB L2).

    python studies/flora_products.py [--out studies/results]

Layouts, for a batch of B tokens with FLoRA rank r on every token (R = B r rows a slice):
  none       the batch alone: one product a group (B rows);
  fused      every FLoRA row through the whole fused weight (B + slices R rows);
  per_slice  each slice of a fused weight (q, k, v; gate, up) on the batch and its own R rows;
  twice      the batch through the fused weight, then each slice on its R rows alone.
Prints a JSON line per (batch, rank, layout): the rows of each product, microseconds a layer,
and the 32-layer step; writes <out>/flora-products-<gpu>.json."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

STUDY_RESULTS = Path("studies/results")
"""Where the studies' results go (run them from the repository root)."""


# (slice widths, in_features) of qkv, o, gate_up, down.
GROUPS = (((4096, 1024, 1024), 4096), ((4096,), 4096), ((14336, 14336), 4096), ((4096,), 14336))
LAYOUTS = ("none", "fused", "per_slice", "twice")
CASES = ((1, 4), (16, 4), (16, 16), (64, 4), (64, 16))
NUM_LAYERS = 8


def products(layout: str, batch: int, rows: int) -> list[tuple[int, int, int, int]]:
    """(group, first output row of the weight, output rows, M) of each product of one layer."""
    out = []
    for group, (slices, _) in enumerate(GROUPS):
        total = sum(slices)
        if layout == "none":
            out.append((group, 0, total, batch))
        elif layout == "fused":
            out.append((group, 0, total, batch + len(slices) * rows))
        else:
            if layout == "twice":
                out.append((group, 0, total, batch))
            start = 0
            for width in slices:
                out.append((group, start, width, batch + rows if layout == "per_slice" else rows))
                start += width
    return out


def layer_us(weights: list[list[torch.Tensor]], inputs: list[tuple]) -> float:
    """Microseconds a layer of the products `inputs` (x, group, first row, rows), from a graph."""
    def step() -> None:
        for layer in weights:
            for x, group, lo, width in inputs:
                F.linear(x, layer[group][lo:lo + width])

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20 / len(weights) * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python studies/flora_products.py")
    parser.add_argument("--out", type=Path, default=STUDY_RESULTS)
    args = parser.parse_args(argv)
    device, dtype = torch.device("cuda"), torch.bfloat16
    weights = [[torch.randn(sum(s), k, device=device, dtype=dtype) for s, k in GROUPS]
               for _ in range(NUM_LAYERS)]
    xs = {k: torch.randn(2048, k, device=device, dtype=dtype) for k in (4096, 14336)}
    rows = []
    for batch, rank in CASES:
        for layout in LAYOUTS:
            plan = products(layout, batch, batch * rank)
            us = layer_us(weights, [(xs[GROUPS[g][1]][:m], g, lo, w) for g, lo, w, m in plan])
            row = dict(batch=batch, rank=rank, layout=layout, rows=[m for *_, m in plan],
                       layer_us=round(us, 1), step_ms_32_layers=round(us * 32 / 1000, 3))
            rows.append(row)
            print(json.dumps(row), flush=True)
    name = torch.cuda.get_device_name().lower().replace(" ", "-")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"flora-products-{name}.json"
    path.write_text(json.dumps(dict(benchmark="flora-products", device=torch.cuda.get_device_name(),
                                    torch=torch.__version__, rows=rows), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

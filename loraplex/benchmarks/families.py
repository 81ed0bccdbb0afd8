"""Decode throughput by adapter family on a Llama-3-8B-shaped model (random bf16 weights, all
seven projections adapted): no adapter, LoRA, DoRA, IA3 and FLoRA alone, and all four mixed
round-robin, at each batch size; then FLoRA against LoRA of the same rank over ranks and batch
sizes (the crossover). Each row beside its floor, as `loraplex bench decode` reports it.

    loraplex bench decode-families [--batch-sizes 1,16,64] [--rank 16] [--flora-rank 4]
        [--crossover-ranks 1,4,16] [--new-tokens 64] [--prompt-len 256] [--out DIR]

Goals (issue 16): DoRA within 5% of LoRA of the same rank; IA3 within 3% of no adapter; FLoRA
rank 4 at batch 16 within 15% of no adapter."""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import torch

from loraplex.benchmarks import decode, synthetic
from loraplex.engine.lora_weights import HostAdapter, group_dims
from loraplex.kernels import engine_ops
from loraplex.model.llama import LORA_GROUPS
from loraplex.model.model_config import ModelConfig

NUM_ADAPTERS = 8
"""Distinct adapters per family (requests take them in turn)."""
FAMILIES = ("none", "lora", "dora", "ia3", "flora", "mixed")


@torch.no_grad()
def family_adapter(config: ModelConfig, family: str, rank: int, dtype: torch.dtype,
                   device: torch.device, name: str, seed: int, pin: bool) -> HostAdapter:
    """A synthetic adapter of `family` on every projection of every layer."""
    if family in ("lora", "dora"):
        host = synthetic.random_adapter(config, rank, dtype, device, name, seed, pin)
        if family == "lora":
            return host
        # Magnitudes near the row norms of W0 (N(0, 0.02) over `in` features), 5% apart.
        generator = torch.Generator(device=device).manual_seed(seed)
        magnitude = {}
        for group in LORA_GROUPS:
            in_features, offsets = group_dims(config, group)
            norm = 0.02 * math.sqrt(in_features)
            m = norm * (1 + 0.05 * torch.randn(config.num_layers, offsets[-1], generator=generator,
                                               device=device))
            magnitude[group] = m.cpu().pin_memory() if pin else m.cpu()
        host.family, host.magnitude, host.digest = "dora", magnitude, f"synthetic-dora-{name}"
        return host
    generator = torch.Generator(device=device).manual_seed(seed)
    a, b, ranks, out_scale, in_scale = {}, {}, {}, {}, {}
    r = 0 if family == "ia3" else rank
    for group, modules in LORA_GROUPS.items():
        in_features, offsets = group_dims(config, group)
        shape_a = (config.num_layers, len(modules), r, in_features)
        shape_b = (config.num_layers, offsets[-1], r)
        a[group] = (1 + 0.05 * torch.randn(shape_a, generator=generator, device=device)).to(dtype).cpu()
        b[group] = ((1 + 0.05 * torch.randn(shape_b, generator=generator, device=device))
                    / max(r, 1)).to(dtype).cpu()
        ranks[group] = torch.full((config.num_layers, len(modules)), r, dtype=torch.int32)
        if family == "ia3":  # PEFT's default for Llama: k, v outputs and the down input
            scale = torch.ones(config.num_layers, offsets[-1])
            if group == "qkv":
                scale[:, offsets[1]:] += 0.1 * torch.randn(
                    config.num_layers, offsets[-1] - offsets[1], generator=generator, device=device).cpu()
            out_scale[group] = scale
            if group in ("o", "down"):
                vector = torch.ones(config.num_layers, in_features)
                if group == "down":
                    vector += 0.1 * torch.randn(config.num_layers, in_features, generator=generator,
                                                device=device).cpu()
                in_scale[group] = vector
    host = HostAdapter(f"synthetic-{family}-{name}", r, a, b, ranks, family,
                       out_scale=out_scale or None, in_scale=in_scale or None)
    if pin:
        for field in ("a", "b", "ranks", "out_scale", "in_scale"):
            tensors = getattr(host, field)
            if tensors is not None:
                setattr(host, field, {g: t.pin_memory() for g, t in tensors.items()})
    return host


def run(args: argparse.Namespace, save: Any = None) -> dict[str, Any]:
    """The rows and the crossover; `save(partial result)` is called after each row (so that a
    run cut short keeps what it measured)."""
    batch_sizes = tuple(int(s) for s in args.batch_sizes.split(","))
    crossover_ranks = tuple(int(s) for s in args.crossover_ranks.split(",") if s)
    config = decode.DecodeBenchConfig(batch_sizes=batch_sizes, prompt_len=args.prompt_len,
                                      new_tokens=args.new_tokens, rank=max(args.rank, *crossover_ranks),
                                      hf_batch_sizes=(), model=json.loads(args.model or "{}"),
                                      device=args.device, dtype=args.dtype)
    device, dtype = torch.device(config.device), getattr(torch, config.dtype)
    pin = device.type == "cuda"
    model_config = synthetic.model_config(config.model)
    max_len = config.prompt_len + config.new_tokens + 16
    model = synthetic.random_model(model_config, engine_ops(device), dtype, device, max_len, seed=0)
    started = time.perf_counter()
    engine = decode._engine(config, model, max_len, flora_graphs=True)
    print(f"engine built in {time.perf_counter() - started:.1f} s "
          f"({engine.lora.num_slots} adapter slots)", flush=True)
    names: dict[tuple[str, int], list[str]] = {}

    def adapters(family: str, rank: int) -> list[str]:
        if (family, rank) not in names:
            made = []
            for i in range(NUM_ADAPTERS):
                name = f"{family}-r{rank}-{i}"
                engine.add_adapter(name, family_adapter(model_config, family, rank, dtype, device, name,
                                                        seed=hash((family, rank, i)) % 2**31, pin=pin))
                made.append(name)
            names[(family, rank)] = made
        return names[(family, rank)]

    def measure(family: str, batch: int, rank: int) -> dict[str, Any]:
        if family == "none":
            request_adapters: list[str | None] = [None] * batch
        elif family == "mixed":
            pools = [adapters(f, rank if f != "flora" else args.flora_rank)
                     for f in ("lora", "dora", "ia3", "flora")]
            request_adapters = [pools[i % 4][(i // 4) % NUM_ADAPTERS] for i in range(batch)]
        else:
            pool = adapters(family, rank)
            request_adapters = [pool[i % NUM_ADAPTERS] for i in range(batch)]
        row = decode._run_ours(engine, config, model_config, batch, family != "none",
                               request_adapters, tag=f"{family}-r{rank}")
        row.update(family=family, rank=0 if family in ("none", "ia3") else rank)
        print(json.dumps(row), flush=True)
        if save is not None:
            save({"benchmark": "decode-families", "device": decode._device_name(device),
                  "torch": torch.__version__, "config": vars(args), "rows": rows,
                  "crossover": crossover, "partial": True})
        return row

    rows: list[dict] = []
    crossover: list[dict] = []
    measure("none", batch_sizes[0], args.rank)  # warm-up (compiles, first copies)
    for batch in batch_sizes:
        for family in FAMILIES:
            rank = args.flora_rank if family == "flora" else args.rank
            rows.append(measure(family, batch, rank))
    for rank in crossover_ranks:
        for batch in batch_sizes:
            crossover += [measure("lora", batch, rank), measure("flora", batch, rank)]
    return {"benchmark": "decode-families", "device": decode._device_name(device),
            "torch": torch.__version__, "config": vars(args), "rows": rows, "crossover": crossover,
            "summary": summarize(rows, crossover, args.rank, args.flora_rank)}


def summarize(rows: list[dict], crossover: list[dict], rank: int, flora_rank: int) -> dict[str, Any]:
    """The goals as ratios of step times, per batch size, and the crossover table."""
    def step(family: str, batch: int, rows_: list[dict] = rows, r: int | None = None) -> float | None:
        for row in rows_:
            if row["family"] == family and row["batch"] == batch and (r is None or row["rank"] == r):
                return row["step_ms"]
        return None

    out: dict[str, Any] = {}
    for batch in sorted({row["batch"] for row in rows}):
        none, lora, dora = step("none", batch), step("lora", batch), step("dora", batch)
        ia3, flora, mixed = step("ia3", batch), step("flora", batch), step("mixed", batch)
        out[f"batch_{batch}"] = {
            "dora_over_lora": round(dora / lora, 3), "dora_goal": "<= 1.05",
            "ia3_over_none": round(ia3 / none, 3), "ia3_goal": "<= 1.03",
            f"flora_r{flora_rank}_over_none": round(flora / none, 3),
            "flora_goal": "<= 1.15 at batch 16",
            "lora_over_none": round(lora / none, 3), "mixed_over_none": round(mixed / none, 3),
        }
    out["crossover_flora_over_lora"] = {
        f"rank_{r}_batch_{b}": round(step("flora", b, crossover, r) / step("lora", b, crossover, r), 3)
        for r in sorted({row["rank"] for row in crossover})
        for b in sorted({row["batch"] for row in crossover})
    }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="loraplex bench decode-families", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--rank", type=int, default=16, help="rank of the LoRA and DoRA adapters")
    parser.add_argument("--flora-rank", type=int, default=4)
    parser.add_argument("--crossover-ranks", default="1,4,16")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model", default="", help="config.json overrides as JSON (a tiny model "
                                                    "for a CPU smoke run)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    def save(result: dict[str, Any]) -> Any:
        device = re.sub(r"[^a-z0-9]+", "-", result["device"].lower()).strip("-")
        path = args.out / f"decode-families-{device}.json"
        path.write_text(json.dumps({**result, "config": {k: str(v) for k, v in result["config"].items()}},
                                   indent=1))
        return path

    result = run(args, save)
    path = save(result)
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

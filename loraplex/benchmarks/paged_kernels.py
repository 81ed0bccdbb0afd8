"""Paged adapters against dense slots (issue 27, step 2): one decode step's adapter work on one
layer (q/k/v, o, gate/up, down), every token with its own adapter, read through rank pages
(kernels/lora_paged.py, adapter_families_paged.py) and through today's slots (lora.py,
adapter_families.py), for each family:
- lora: shrink + expand of every group (rank 16);
- dora: the same with the expand's scale epilogue;
- ia3: o's input scaling, and the expand's epilogue (rank 0) on o and down (q/k/v's and gate/up's
  vectors go to the rotary and activation kernels, which still read slots);
- flora: stack + combine of every group (rank 4; the base products, the same both ways, left out).
Slots are as wide as the rank (no padding), so the ratio is the cost of the page lookups alone.

    loraplex bench kernels --paged [--tiny] [--out bench/results]

On a GPU: Llama-3-8B shapes in bf16, 64 tokens and adapters, timed by CUDA-graph replays over
enough layers' inputs to defeat L2 (kernel_speed.time_per_call); goal: paged / slots <= 1.03.
`--tiny` (and any run on the CPU, under TRITON_INTERPRET=1) takes a toy shape and wall-clock
time: it checks that the comparison runs, not speed. Writes bench/results/kernels-paged-<device>.json.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.benchmarks.results import write
from loraplex.benchmarks.synthetic import model_config
from loraplex.engine.adapter_pages import adapter_pool_pages, page_slot_group
from loraplex.engine.lora_weights import pool_slot_bytes
from loraplex.engine.sizing import kv_block_bytes
from loraplex.kernels import adapter_families as fam
from loraplex.kernels import adapter_families_paged as famp
from loraplex.kernels import lora, lora_paged
from loraplex.kernels._common import is_interpreting
from loraplex.model.llama import FLORA_FUSED_MAX_ROWS

FAMILIES = ("lora", "dora", "ia3", "flora")
GOAL = 1.03


@dataclass(frozen=True)
class Shape:
    hidden: int
    q_size: int
    kv_size: int
    intermediate: int
    num_tokens: int
    """Tokens of the decode step, each with its own adapter."""
    rank: int
    flora_rank: int
    page_bytes: int
    """The pool's page (a KV block: 2 MiB for Llama-3-8B, 16 tokens)."""
    dtype: torch.dtype

    def groups(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """group -> (in_features, slice_offsets)."""
        h, q, kv, i = self.hidden, self.q_size, self.kv_size, self.intermediate
        return {"qkv": (h, (0, q, q + kv, q + 2 * kv)), "o": (q, (0, h)),
                "gate_up": (h, (0, i, 2 * i)), "down": (i, (0, h))}


LLAMA3_8B = Shape(4096, 4096, 1024, 14336, 64, 16, 4, 2 << 20, torch.bfloat16)
TINY = Shape(32, 32, 16, 64, 2, 8, 4, 4096, torch.float32)


def _group_inputs(shape: Shape, family: str, in_features: int, offsets: tuple[int, ...], group: str,
                  device: torch.device, g: torch.Generator) -> dict:
    """One group's slot buffers and their paged copy, for num_tokens adapters (slot 0 empty)."""
    S, T, out = shape.num_tokens + 1, shape.num_tokens, offsets[-1]
    num_slices = len(offsets) - 1
    rank = {"lora": shape.rank, "dora": shape.rank, "ia3": 0, "flora": shape.flora_rank}[family]
    max_rank = max(rank, 1)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=g) * scale).to(device, shape.dtype)

    a = randn(S, num_slices, max_rank, in_features, scale=in_features ** -0.5)
    b = randn(S, out, max_rank)
    ranks = torch.full((S, num_slices), rank, dtype=torch.int32)
    ranks[0] = 0
    is_scaled = family == "dora" or (family == "ia3" and group in ("o", "down"))
    scaled, in_scaled = [False] + [is_scaled] * T, [False] + [family == "ia3" and group == "o"] * T
    scale = (1 + 0.1 * torch.randn(S, out, generator=g)).to(device)
    in_scale = (1 + 0.1 * torch.randn(S, in_features, generator=g)).to(device)
    bt = b.transpose(1, 2).contiguous()
    sizes = (a.numel() + b.numel()) * a.element_size() + 4 * (S * (out + in_features))
    num_pages = 2 * (sizes // shape.page_bytes) + 2 * S + 8
    pool = torch.zeros(num_pages * shape.page_bytes, dtype=torch.uint8, device=device)
    free = list(range(num_pages))
    random.Random(0).shuffle(free)  # pages anywhere in the pool
    paged = page_slot_group(pool, shape.page_bytes, free.pop, a, bt, ranks.to(device), offsets, scale,
                            None, scaled, in_scale, in_scaled)
    is_flora = family == "flora"
    row_tokens = torch.arange(T).repeat_interleave(rank) if is_flora else torch.zeros(0, dtype=torch.long)
    rows = (row_tokens.to(device), (row_tokens + 1).to(device, torch.int32),
            torch.arange(rank).repeat(T).to(device))
    num_rows = len(row_tokens)
    per_slice = num_slices > 1 and T + num_slices * num_rows > FLORA_FUSED_MAX_ROWS
    num_products = (T + num_rows) * out if per_slice else (T + num_slices * num_rows) * out
    return dict(
        x=randn(T, in_features), y=randn(T, out),
        slots=torch.arange(1, T + 1, dtype=torch.int32, device=device),
        a=a, b=b, bt=bt, ranks=ranks.to(device), offsets=offsets, max_rank=max_rank,
        scale=scale, scaled=torch.tensor(scaled, dtype=torch.int32, device=device), in_scale=in_scale,
        pool=pool, paged=paged, rows=rows, num_rows=num_rows, per_slice=per_slice,
        bounds=torch.arange(0, (T + 1) * rank, max(rank, 1))[:T + 1].to(device) if is_flora else None,
        products=randn(num_products), group=group)


def make_inputs(shape: Shape, family: str, device: torch.device, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [_group_inputs(shape, family, in_features, offsets, group, device, g)
            for group, (in_features, offsets) in shape.groups().items()]


def run_slots(family: str, groups: list[dict]) -> list[torch.Tensor]:
    """One layer's adapter work through dense slots; its outputs."""
    outs = []
    for i in groups:
        if family == "flora":
            outs.append(fam.flora_stack(i["x"], i["a"], i["ranks"], *i["rows"], i["per_slice"]))
            outs.append(fam.flora_combine(i["products"], i["bt"], i["slots"], i["ranks"], i["bounds"],
                                          i["offsets"], i["num_rows"], i["per_slice"]))
            continue
        if family == "ia3" and i["group"] in ("qkv", "gate_up"):
            continue
        x = i["x"]
        if family == "ia3" and i["group"] == "o":
            x = fam.scale_rows(x, i["in_scale"], i["slots"])
        shrunk = lora.lora_shrink(x, i["a"], i["slots"], i["ranks"])
        epilogue = (i["scale"], i["scaled"]) if family != "lora" else ()
        outs.append(lora.lora_expand(i["y"], shrunk, i["b"], i["slots"], i["ranks"], i["offsets"], *epilogue))
    return outs


def run_paged(family: str, groups: list[dict]) -> list[torch.Tensor]:
    """The same work through rank pages; its outputs."""
    outs = []
    for i in groups:
        p, weights = i["paged"], i["pool"].view(i["x"].dtype)
        vectors = i["pool"].view(torch.float32)
        if family == "flora":
            outs.append(famp.flora_stack_paged(i["x"], weights, p.a_pages, i["ranks"], *i["rows"],
                                               i["per_slice"]))
            outs.append(famp.flora_combine_paged(i["products"], weights, p.b_pages, i["slots"], i["ranks"],
                                                 i["bounds"], i["offsets"], i["num_rows"], i["per_slice"]))
            continue
        if family == "ia3" and i["group"] in ("qkv", "gate_up"):
            continue
        x = i["x"]
        if family == "ia3" and i["group"] == "o":
            x = famp.scale_rows_paged(x, vectors, p.in_scale_at, i["slots"])
        shrunk = lora_paged.lora_shrink_paged(x, weights, p.a_pages, i["slots"], i["ranks"], i["max_rank"])
        epilogue = (vectors, p.scale_at) if family != "lora" else ()
        outs.append(lora_paged.lora_expand_paged(i["y"], shrunk, weights, p.b_pages, i["slots"], i["ranks"],
                                                 i["offsets"], *epilogue))
    return outs


def max_difference(family: str, groups: list[dict]) -> float:
    """The largest difference between the paged and the slot outputs on the same inputs (y
    fresh for each), relative to the outputs' largest magnitude: the two do the same work."""
    outs = [run(family, [{**i, "y": i["y"].clone()} for i in groups]) for run in (run_slots, run_paged)]
    worst = 0.0
    for want, got in zip(*outs):
        scale = want.float().abs().max().clamp_min(1e-30)
        worst = max(worst, ((got.float() - want.float()).abs().max() / scale).item())
    return worst


def _seconds(fn, sets: list, device: torch.device) -> float:
    if device.type == "cuda":
        from loraplex.benchmarks.kernel_speed import time_per_call

        return time_per_call(fn, sets)
    start = time.perf_counter()  # the interpreter: one pass, only to show that it runs
    for s in sets:
        fn(s)
    return (time.perf_counter() - start) / len(sets)


def compare(shape: Shape, device: torch.device, num_sets: int) -> list[dict]:
    """Per family: microseconds per step (one layer) through slots and pages, and their ratio."""
    rows = []
    for family in FAMILIES:
        sets = [make_inputs(shape, family, device, seed) for seed in range(num_sets)]
        difference = max_difference(family, sets[0])
        slots = _seconds(lambda s, f=family: run_slots(f, s), sets, device)
        paged = _seconds(lambda s, f=family: run_paged(f, s), sets, device)
        rows.append({"family": family, "slots_us": slots * 1e6, "paged_us": paged * 1e6,
                     "ratio": paged / slots, "pass": paged / slots <= GOAL,
                     "max_relative_difference": difference})
        print(f"  {family:<6} slots {slots * 1e6:10.1f} us  paged {paged * 1e6:10.1f} us  "
              f"ratio {paged / slots:6.3f}  (outputs differ by {difference:.1e} of their largest)",
              flush=True)
        del sets
    return rows


def pages_per_adapter() -> dict:
    """Pool pages (2 MiB KV blocks) a Llama-3-8B bf16 adapter on all seven modules takes, paged
    by its own rank against step 1's slots of --max-lora-rank 64 (any adapter)."""
    config = model_config()
    page = kv_block_bytes(config, 16, torch.bfloat16)
    paged = {rank: adapter_pool_pages(config, rank, torch.bfloat16, page) for rank in (8, 16, 64)}
    slot = pool_slot_bytes(config, 64, torch.bfloat16, page) // page
    print(f"Llama-3-8B adapter, pool pages of 2 MiB: paged rank 8/16/64 {paged[8]}/{paged[16]}/{paged[64]}, "
          f"a slot of max rank 64 {slot}")
    return {"page_bytes": page, "paged_by_rank": paged, "slot_max_rank_64": slot}


def run(out: Path, tiny: bool = False) -> Path:
    """Run the comparison and write its JSON; returns the path."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not is_interpreting():
        raise SystemExit("without a GPU, run the comparison under TRITON_INTERPRET=1")
    shape = TINY if tiny or device.type != "cuda" else LLAMA3_8B
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"paged adapters against slots on {name}: {shape.num_tokens} tokens, each its own adapter, "
          f"one layer of every group (ratio goal <= {GOAL} on the H100)")
    torch.manual_seed(0)
    rows = compare(shape, device, num_sets=2 if device.type == "cuda" else 1)
    result = {"device": name, "shape": {k: str(v) for k, v in vars(shape).items()},
              "interpreted": device.type != "cuda", "goal_ratio": GOAL, "results": rows,
              "llama3_8b_pool_pages_per_adapter": pages_per_adapter()}
    path = write(result, out, name="kernels-paged")
    print(f"wrote {path}")
    return path

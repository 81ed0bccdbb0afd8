"""Does splitting a tile-path step's lone tokens (decode rows beside other adapters' rows) off to
the per-token kernels (lora_paged.SPLIT_LONE) make its LoRA shrink and expand cheaper when the
decode rows carry distinct adapters, and what does the split cost when they do not? (GPU; issue
27: 112 decodes with 112 adapters beside a 768-token prompt cost 67.5 ms against 40.5 with one
adapter on the H200.)

One Llama-3-8B layer's shapes (qkv: in 4,096, three slices; gate_up: 4,096, two; down: 14,336,
one), rank 16, bf16, TOKENS tokens each (default 880 and 8,192): DECODES decode rows first
(adapters 1..DECODES, or all adapter 1), then a prompt of the rest on one adapter. The paged
shrink and expand timed (do_bench median) with SPLIT_LONE off (every token in the tiles) and on.

    python studies/lone_rows.py [--decodes 112] [--tokens 880,8192] [--out X.json]"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton.testing

from loraplex.benchmarks import synthetic
from loraplex.engine.lora_weights import LoraSlotBuffers, group_dims
from loraplex.kernels import lora_paged


def _bench_us(fn) -> float:
    if torch.cuda.is_available():
        return round(1e3 * triton.testing.do_bench(fn, warmup=5, rep=40), 1)
    started = time.perf_counter()  # (a check of the script under the Triton interpreter)
    fn()
    return round(1e6 * (time.perf_counter() - started), 1)


def _time_group(group, name: str, config, slots: torch.Tensor, num_tokens: int) -> dict:
    """Shrink and expand microseconds of one layer's group with SPLIT_LONE off and on (the split
    made once, as the engine makes it once a forward pass, and timed apart), and the largest
    difference between the two paths' outputs."""
    in_features, _ = group_dims(config, name)
    dtype = group.pool.dtype
    x = torch.randn(num_tokens, in_features, device=slots.device, dtype=dtype)
    y = torch.randn(num_tokens, group.slice_offsets[-1], device=slots.device, dtype=dtype)
    accumulated = y.clone()  # (what the timed expands add into)

    def shrink(split) -> torch.Tensor:
        return lora_paged.lora_shrink_paged(x, group.pool, group.a_pages, slots, group.ranks, 16, split)

    def expand(shrunk: torch.Tensor, split, out: torch.Tensor) -> torch.Tensor:
        return lora_paged.lora_expand_paged(out, shrunk, group.pool, group.b_pages, slots, group.ranks,
                                            group.slice_offsets, split=split)

    row, outputs = {}, []
    for on in (False, True):
        lora_paged.SPLIT_LONE = on
        split = lora_paged.lone_split(slots)
        if on:
            row["lone_split_us"] = _bench_us(lambda: lora_paged.lone_split(slots))
        shrunk = shrink(split)
        outputs.append((shrunk, expand(shrunk, split, y.clone())))
        row[f"shrink_us_split_{on}"] = _bench_us(lambda split=split: shrink(split))
        row[f"expand_us_split_{on}"] = _bench_us(
            lambda shrunk=shrunk, split=split: expand(shrunk, split, accumulated))
    row["shrunk_max_abs_diff"] = float((outputs[0][0] - outputs[1][0]).abs().max())
    row["y_max_abs_diff"] = float((outputs[0][1].float() - outputs[1][1].float()).abs().max())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decodes", type=int, default=112)
    parser.add_argument("--tokens", default="880,8192")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--model-overrides", type=json.loads, default={}, help="a smaller shape (CPU check)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = synthetic.model_config({**args.model_overrides, "num_hidden_layers": 1})
    num_slots = args.decodes + 1
    buffers = LoraSlotBuffers(config, num_slots, 16, dtype, device)
    for slot in range(1, num_slots + 1):
        host = synthetic.random_adapter(config, 16, dtype, device, f"s{slot}", slot,
                                        pin=device.type == "cuda")
        buffers.load(slot, host, buffers.own_pages_of(slot, buffers.pages_for(host)))
    rows = []
    for num_tokens in map(int, args.tokens.split(",")):
        for distinct in (1, args.decodes):
            slots = torch.full((num_tokens,), num_slots, dtype=torch.int32, device=device)
            slots[:args.decodes] = torch.arange(args.decodes, device=device) % distinct + 1
            for name in ("qkv", "gate_up", "down"):
                row = {"tokens": num_tokens, "distinct_adapters": distinct, "group": name,
                       **_time_group(buffers.group(0, name), name, config, slots, num_tokens)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    lora_paged.SPLIT_LONE = True
    if args.out:
        result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "rows": rows}
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

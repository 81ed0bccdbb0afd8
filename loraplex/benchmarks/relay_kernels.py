"""RelayAttention decode (prefix kernel + own-part decode with the merge fused) against plain
paged decode over the whole context, at the Llama-3-8B attention shape (32 q heads, 8 KV
heads, head dim 128, bf16, 16-token blocks), one layer (GPU only).

    loraplex bench relay-kernels [--group-sizes 1,2,4,8,16,32,64] [--prefix-lens 128,512,2048,4096]
                                 [--batches 64,128,256] [--own-len 160] [--sweep] [--out bench/results]

A batch of B decoding requests is made of B / n groups of n members; each group shares a
prefix of s tokens (its blocks shared by the members' tables, as the prefix cache leaves
them) and each request has own-len tokens of its own. The plain path reads every request's
whole table (prefix cache without relay: what vLLM does); relay reads each prefix once a group.
Times are per call, from CUDA-graph replays cycling over enough input sets to miss L2 (as
`loraplex bench kernels`). Each figure sits next to its floor, the bytes the step must read
(each distinct KV token once, q read, output written) / 3.0 TB/s; the plain path's nominal
bytes (every request's whole context) are given too. The crossover (smallest group size at
which relay is faster, per prefix length and batch) and the rule drawn from it go into
bench/results/relay-kernels-<gpu>.json. `--sweep` times the prefix kernel's candidate configs
instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from loraplex.benchmarks.kernel_speed import (
    ceiling_bytes_per_s,
    gpu_bench_meta,
    gpu_slug,
    num_sets,
    time_per_call,
)
from loraplex.benchmarks.results import RESULTS
from loraplex.kernels import decode_attention, relay_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
KV_BYTES_PER_TOKEN = KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16: 4 KiB a token a layer
SCALE = HEAD_DIM ** -0.5


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def make_inputs(batch: int, group_size: int, prefix_len: int, own_len: int,
                device: str = "cuda") -> tuple:
    """(q, kv_layer, block_tables, seq_lens, prefix_lens, members, group_starts):
    batch // group_size groups of consecutive rows, shared prefix blocks, shuffled blocks."""
    num_groups = batch // group_size
    prefix_blocks, own_blocks = -(-prefix_len // BLOCK_SIZE), -(-own_len // BLOCK_SIZE)
    num_blocks = num_groups * prefix_blocks + batch * own_blocks
    kv = torch.randn(num_blocks, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    prefix_ids = perm[:num_groups * prefix_blocks].view(num_groups, prefix_blocks)
    own_ids = perm[num_groups * prefix_blocks:].view(batch, own_blocks)
    group_of_row = torch.arange(batch, device=device) // group_size
    tables = torch.cat([prefix_ids[group_of_row], own_ids], dim=1).contiguous()
    full = lambda v: torch.full((batch,), v, dtype=torch.int32, device=device)
    members = torch.arange(batch, dtype=torch.int32, device=device)
    starts = torch.arange(0, batch + 1, group_size, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    return q, kv, tables, full(prefix_len + own_len), full(prefix_len), members, starts


def bench_case(batch: int, group_size: int, prefix_len: int, own_len: int,
               prefix_config: relay_attention.RelayConfig | None = None) -> dict:
    num_groups = batch // group_size
    io = 2 * batch * HEADS * HEAD_DIM * 2  # q read, out written
    unique = (num_groups * prefix_len + batch * own_len) * KV_BYTES_PER_TOKEN + io
    nominal = batch * (prefix_len + own_len) * KV_BYTES_PER_TOKEN + io
    sets = [make_inputs(batch, group_size, prefix_len, own_len) for _ in range(num_sets(unique))]
    calls = max(8, min(64, int(4e9 // nominal)))
    q, _, tables = sets[0][:3]
    context = tables.shape[1] * BLOCK_SIZE
    plain_cfg = decode_attention.decode_config(batch, KV_HEADS, context, HEAD_DIM, q.device)
    own_cfg = plain_cfg
    cfg = prefix_config or relay_attention.relay_config(batch, KV_HEADS, HEADS // KV_HEADS, context,
                                                        HEAD_DIM, q.device)
    plain = lambda s: decode_attention._launch(s[0], s[1], s[2], s[3], SCALE, plain_cfg)
    relay = lambda s: relay_attention._launch(*s, SCALE, own_cfg, cfg)
    prefix = lambda s: relay_attention._launch_prefix(s[0], s[1], s[2], s[4], s[5], s[6], SCALE, cfg)
    # the two paths agree (bf16) before they are timed
    err = (relay(sets[0]).float() - plain(sets[0]).float()).abs().max().item()
    t_plain = time_per_call(plain, sets, min_calls=calls)
    t_relay = time_per_call(relay, sets, min_calls=calls)
    t_prefix = time_per_call(prefix, sets, min_calls=calls)
    partials = batch * HEADS * cfg.num_splits * (HEAD_DIM + 1) * 4 * 2  # written, read
    floor = unique / ceiling_bytes_per_s()
    return {
        "batch": batch, "group_size": group_size, "num_groups": num_groups,
        "prefix_len": prefix_len, "own_len": own_len,
        "relay_us": t_relay * 1e6, "relay_prefix_kernel_us": t_prefix * 1e6,
        "plain_us": t_plain * 1e6, "speedup": t_plain / t_relay,
        "floor_us": floor * 1e6, "relay_over_floor": t_relay / floor,
        "plain_over_floor": t_plain / floor,
        "plain_nominal_floor_us": nominal / ceiling_bytes_per_s() * 1e6,
        "unique_bytes": unique, "nominal_bytes": nominal, "relay_partial_bytes": partials,
        "predicted_io_speedup": nominal / unique, "max_abs_diff_vs_plain": err,
        "prefix_config": asdict(cfg), "decode_config": asdict(plain_cfg),
    }


def crossover(results: list[dict]) -> dict:
    """Per prefix length and batch, the smallest group size from which relay is faster at
    every larger size measured; and the rule over all batches (the largest of those)."""
    table: dict[str, dict[str, int | None]] = {}
    for s in sorted({r["prefix_len"] for r in results}):
        row = {}
        for b in sorted({r["batch"] for r in results}):
            cases = sorted((r for r in results if r["prefix_len"] == s and r["batch"] == b),
                           key=lambda r: r["group_size"])
            n_min = None
            for i, r in enumerate(cases):
                if all(c["speedup"] > 1.0 for c in cases[i:]):
                    n_min = r["group_size"]
                    break
            row[str(b)] = n_min
        table[str(s)] = row
    rule = {}
    for s, row in table.items():
        found = [n for n in row.values() if n is not None]
        rule[s] = max(found) if len(found) == len(row) else None
    text = "; ".join(f"prefix {s}: group size >= {n}" if n else f"prefix {s}: never measured faster"
                     for s, n in rule.items())
    return {"min_group_size_by_prefix_and_batch": table, "min_group_size_by_prefix": rule,
            "rule": f"use relay for a group when {text} (else the plain path)"}


def sweep(out: list[dict], path: Path, meta: dict) -> None:
    for batch, n, s in ((64, 64, 2048), (64, 8, 2048), (256, 64, 2048), (256, 4, 512),
                        (128, 32, 4096)):
        for cfg in relay_attention.CANDIDATE_CONFIGS:
            _record(out, path, meta, batch, n, s, 160, cfg)


def _record(out, path, meta, batch, n, s, own_len, cfg=None) -> None:
    try:
        r = bench_case(batch, n, s, own_len, cfg)
    except Exception as e:  # one failing case must not lose the others' numbers
        print(f"FAILED batch={batch} n={n} s={s}: {e!r}", file=sys.stderr)
        return
    out.append(r)
    print(f"  B={batch:<4} n={n:<3} s={s:<5} relay {r['relay_us']:8.1f} us "
          f"(prefix {r['relay_prefix_kernel_us']:7.1f}) plain {r['plain_us']:8.1f} us "
          f"x{r['speedup']:5.2f} (IO bound x{r['predicted_io_speedup']:5.2f}) "
          f"floor {r['floor_us']:7.1f} us relay/floor {r['relay_over_floor']:5.2f} "
          f"splits {r['prefix_config']['num_splits']} diff {r['max_abs_diff_vs_plain']:.3g}",
          flush=True)
    summary = {} if meta.get("sweep") else crossover(out)
    path.write_text(json.dumps({**meta, "crossover": summary, "results": out}, indent=1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group-sizes", type=_ints, default=(1, 2, 4, 8, 16, 32, 64))
    parser.add_argument("--prefix-lens", type=_ints, default=(128, 512, 2048, 4096))
    parser.add_argument("--batches", type=_ints, default=(64, 128, 256))
    parser.add_argument("--own-len", type=int, default=160,
                        help="each request's own tokens (default 160: 64 prompt + half of 192 new)")
    parser.add_argument("--sweep", action="store_true", help="time the prefix kernel's configs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    meta = gpu_bench_meta("relay-kernels", shape={"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                                  "block_size": BLOCK_SIZE, "dtype": "bfloat16"},
                          own_len=args.own_len, sweep=args.sweep)
    name = meta["device"]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"relay-kernels-{gpu_slug(name)}{'-sweep' if args.sweep else ''}.json"
    results: list[dict] = []
    if args.sweep:
        sweep(results, path, meta)
    else:
        for batch in args.batches:
            for s in args.prefix_lens:
                for n in args.group_sizes:
                    if batch % n == 0:
                        _record(results, path, meta, batch, n, s, args.own_len)
        print(json.dumps(crossover(results), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Which scheduler settings meet issue 29's goals in the fairness simulation, over seeds?
(light tenants' p99 TTFT <= 1.5x alone, p99 TBT <= 1.1x alone, VTC throughput >= 0.95x FCFS;
`loraplex bench fairness-sim`'s workload and H100 step model.) Each named configuration runs
the benchmark's three runs per seed; one JSON line per (configuration, seed) is appended to
the output, and a table of per-seed figures and medians is printed.

    python studies/fairness_sim_sweep.py --seeds 0 1 2 3 4 \
        --config base max_num_batched_tokens=8192 --config b2048 max_num_batched_tokens=2048 \
        --config sp256-b2048 system_prompt_len=256 max_num_batched_tokens=2048"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import fields
from pathlib import Path

from loraplex.benchmarks.fairness_sim import FairnessSimConfig, simulate
from loraplex.benchmarks.fairness_workload import FairnessWorkload

KEYS = {"ttft": "light p99 TTFT vs alone (vtc)", "tbt": "light p99 TBT vs alone (vtc)",
        "tput": "throughput vtc / fcfs"}
GOALS = {"ttft": (1.5, max), "tbt": (1.1, max), "tput": (0.95, min)}


def parse_config(words: list[str]) -> tuple[str, dict]:
    name, options = words[0], {}
    names = {f.name: f for f in fields(FairnessSimConfig)} | {"system_prompt_len": None}  # (the workload's)
    for word in words[1:]:
        key, value = word.split("=", 1)
        if key not in names:
            raise SystemExit(f"unknown option {key}")
        options[key] = json.loads(value)
    return name, options


def row(name: str, options: dict, seed: int) -> dict:
    options = dict(options)
    workload = FairnessWorkload(seed=seed, system_prompt_len=options.pop("system_prompt_len", 0))
    config = FairnessSimConfig(workload=workload, **options)
    started = time.perf_counter()
    result = simulate(config)
    if workload.system_prompt_len:
        options["system_prompt_len"] = workload.system_prompt_len
    vtc, alone = result["runs"]["vtc"], result["runs"]["light tenants alone (vtc)"]
    figures = {short: result["summary"][key] for short, key in KEYS.items()}
    return {"config": name, "options": options, "seed": seed, **figures,
            "light_vtc": {k: vtc["light"][k] for k in ("ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s")},
            "light_alone": {k: alone["light"][k] for k in ("ttft_p99_s", "tbt_p99_s")},
            "heavy_started": f"{vtc['heavy']['started']}/{vtc['heavy']['requests']}",
            "preemptions_per_minute": vtc["preemptions_per_minute"],
            "output_tokens_per_s": {"vtc": vtc["output_tokens_per_s"],
                                    "fcfs": result["runs"]["fcfs"]["output_tokens_per_s"]},
            "cpu_s": round(time.perf_counter() - started, 1)}


def table(rows: list[dict]) -> str:
    lines = [f"{'config':28s} {'seed':>6s} {'TTFT':>6s} {'TBT':>6s} {'tput':>6s}  preemptions/min (vtc)"]
    by_config: dict[str, list[dict]] = {}
    for r in rows:
        by_config.setdefault(r["config"], []).append(r)
    for name, group in by_config.items():
        for r in sorted(group, key=lambda r: r["seed"]):
            pre = " ".join(f"{k} {v}" for k, v in r["preemptions_per_minute"].items())
            figures = f"{r['ttft']:6.3f} {r['tbt']:6.3f} {r['tput']:6.3f}"
            lines.append(f"{name:28s} {r['seed']:>6d} {figures}  {pre}")
        med = {k: statistics.median(r[k] for r in group) for k in KEYS}
        causes = sorted({c for r in group for c in r["preemptions_per_minute"]})
        pre = " ".join(f"{c} {statistics.median(r['preemptions_per_minute'].get(c, 0) for r in group):.1f}"
                       for c in causes)
        ok = all((med[k] <= goal) if how is max else (med[k] >= goal) for k, (goal, how) in GOALS.items())
        every = all(all((r[k] <= goal) if how is max else (r[k] >= goal) for k, (goal, how) in GOALS.items())
                    for r in group)
        figures = f"{med['ttft']:6.3f} {med['tbt']:6.3f} {med['tput']:6.3f}"
        verdict = f"goals: median {'met' if ok else 'missed'}, every seed {'met' if every else 'missed'}"
        lines.append(f"{name:28s} {'median':>6s} {figures}  {pre}  {verdict}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--config", nargs="+", action="append", default=[],
                        help="NAME [OPTION=JSON ...] (FairnessSimConfig fields)")
    parser.add_argument("--out", type=Path, default=Path("studies/results/fairness-sim-sweep.jsonl"))
    parser.add_argument("--table", action="store_true", help="only print the table of --out (--seeds)")
    args = parser.parse_args()
    if not args.table:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        for words in args.config:
            name, options = parse_config(words)
            for seed in args.seeds:
                result = row(name, options, seed)
                with args.out.open("a") as out:
                    out.write(json.dumps(result) + "\n")
                print(json.dumps({k: result[k] for k in ("config", "seed", *KEYS, "preemptions_per_minute",
                                                         "cpu_s")}), flush=True)
    rows = [json.loads(line) for line in args.out.read_text().splitlines()]
    names = [parse_config(words)[0] for words in args.config]
    print(table([r for r in rows if (not names or r["config"] in names) and r["seed"] in args.seeds]))


if __name__ == "__main__":
    main()

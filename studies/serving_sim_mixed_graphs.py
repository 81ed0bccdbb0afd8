"""The slot simulation (loraplex/benchmarks/slot_sim.py) calibrated to the H100 serving pass with
mixed-step CUDA graphs (bench/results/serve-h100-pool-2026-11-28/3-mixed-graphs/, "run 3":
Llama-3-8B shape, 1,000 rank-16 adapters over 40 tenants, Zipf 1.0, no --max-loras, 128 running,
8,192 tokens a step; steps with prompt tokens replay graphs up to 1,024 padded tokens, so the
scheduler delay is off), then the scheduler's and the loader's settings swept on it, one at a
time and combined, against issue 27's goals.

1. `calibrate`: the step model's HTTP share of the base, its cost a sampled token and a mixed
   graph's cost a prompt token, by a grid to the five one-adapter rate runs (mean TPOT and median
   ITL); the request overhead from their TTFT p50; then how much of a host load holds the engine,
   by a grid to the runs that start cold (offline throughput; poisson-1000's and rate-1000-0.7's
   p99 TTFT and throughput), serving the pass in its order on one engine. Prints the check
   against every run of run 3.
2. `sweep NAME ...`: the named settings of SETTINGS (default: all), each serving the pass's
   sequence: the offline pass (the saturation workload through the engine directly, on a fresh
   engine), then the HTTP runs in the benchmark's order, then a one-adapter Poisson run at the
   Poisson runs' rate (the goals' reference, simulated only); then, on other workload seeds
   (--seeds), the offline pass, saturation and the three Poisson runs again on a fresh engine
   each, since 600-request runs near their tipping point move with the seed.

    PYTHONPATH=. python -m studies.serving_sim_mixed_graphs calibrate   # about 8 minutes
    PYTHONPATH=. python -m studies.serving_sim_mixed_graphs calibrate loads   # the loads alone
    PYTHONPATH=. python -m studies.serving_sim_mixed_graphs sweep base hold ...   # 1-2 min a setting
    PYTHONPATH=. python -m studies.serving_sim_mixed_graphs table   # the sweep as a markdown table

Everything goes into studies/results/serving-sim-mixed-graphs-h100.json (each command updates
its own keys); studies/results/serving-sim-mixed-graphs-h100.md has the tables."""

from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from loraplex.benchmarks.slot_sim import SlotSimConfig, SlotSimulation, StepModel
from studies.serving_sim_pool import (
    MEASURED_DIR,
    ORDER,
    RATE_FACTORS,
    compare_line,
    fit_decode_line,
    load_measured,
    serve_figures,
    workload_of,
)

RUN_3 = "3-mixed-graphs"
OUT = Path(__file__).parent / "results" / "serving-sim-mixed-graphs-h100.json"
OFFLINE, REFERENCE = "offline", "poisson-1"
POISSON_RUNS = (OFFLINE, "saturation-1000", "poisson-1000", "poisson-32", REFERENCE)
RATIOS = {
    "ttft_p99_ratio_to_1": ("poisson-1000", REFERENCE, "ttft_p99_ms"),
    "throughput_ratio_to_32": ("poisson-1000", "poisson-32", "output_throughput"),
    "offline_over_http": (OFFLINE, "saturation-1000", "output_throughput"),
}
"""The goals' ratios (numerator run, denominator run, figure) taken per seed."""
TTFT_TARGET_MS = 1000.0

MIXED_GRAPH_TOKENS = 1024
EAGER_FLOOR_MS = 42.6
"""Steps over 1,024 padded tokens still run eagerly (the floor of run 2's calibration)."""
HTTP_BASE_MS = (0.0, 0.5, 1.0, 1.5)
PER_SAMPLED_MS = (0.0, 0.0125, 0.025)
PER_MIXED_TOKEN_MS = (0.0075, 0.01, 0.0125, 0.015, 0.02, 0.03)
HOST_LOAD_MS = 100.0
"""The other threads' CPU a host load in run 3's load-heavy runs (poisson-1000: 19.9 s for 198;
rate-1000-0.7: 9.5 s for 93)."""
HOLDS_ENGINE = (0.0, 0.25, 0.5, 0.6, 0.75, 0.9, 1.0)
COLD_RUNS = ("poisson-1000", "rate-1000-0.7")
"""The HTTP runs that start with most of their adapters on neither tier (93 to 198 host loads)."""
LOAD_THREADS = 2
"""loraplex/engine/adapter_cache.py's LOAD_THREADS at run 3 (21b4e7b)."""

SETTINGS: dict[str, dict[str, Any]] = {
    "base": {},
    "hold": {"hold_places_for_loading": True},
    "bound-16384": {"fairness_bound": 16384.0},
    "bound-65536": {"fairness_bound": 65536.0},
    "bound-inf": {"fairness_bound": math.inf},
    "seqs-256": {"max_num_seqs": 256},
    "threads-1": {"num_load_threads": 1},
    "threads-4": {"num_load_threads": 4},
    "threads-8": {"num_load_threads": 8},
    "load-50ms": {"host_load_ms": 50.0},
    "load-25ms": {"host_load_ms": 25.0},
    "no-hold-engine": {"host_load_holds_engine": 0.0},
    "host-256": {"max_host_adapters": 256},
    "skip-resident": {},
    "fcfs": {"policy": "fcfs"},
}
"""One factor at a time from the calibrated engine as run 3 ran it (vtc, bound 4,096, hold off,
128 running, 2 load threads of 100 ms, a host tier of 64 adapters: --max-cpu-loras unset);
combinations are added by name with '+' (`hold+seqs-256`). "skip-resident" is not a setting but a
what-if of the scheduler's code: its prefetch of the queue's adapters skips those resident on the
device (today it reads them into the host tier again, the host loads that run 3's warm runs made
with no slot load)."""
SKIPS_RESIDENT = "skip-resident"


def setting_config(base: SlotSimConfig, name: str) -> SlotSimConfig:
    """`base` with the setting `name` (names of SETTINGS joined by '+')."""
    changes: dict[str, Any] = {}
    for part in name.split("+"):
        changes.update(SETTINGS[part])
    config = replace(base, **changes)
    if config.max_num_seqs != base.max_num_seqs:  # the engine captures a graph at max_num_seqs
        seqs = tuple(sorted({s for s in (8, 32, 128) if s < config.max_num_seqs} | {config.max_num_seqs}))
        config = replace(config, step=replace(config.step, mixed_graph_seqs=seqs))
    return config


def load_offline(run: str) -> dict[str, Any]:
    data = json.loads((MEASURED_DIR / run / "serve-offline-nvidia-h100-80gb-hbm3.json").read_text())
    return {
        "workload": data["workload"],
        "output_throughput": data["output_throughput"],
        "preemptions": data["preemptions"],
        "host_loads": data["adapter_host_loads"],
    }


def skip_resident_prefetch(sim: SlotSimulation) -> None:
    """The what-if "skip-resident": `sim`'s cache starts no host load for an adapter resident
    on the device (the scheduler's prefetch of the queue asks for one today)."""
    cache, prefetch = sim.adapters, sim.adapters.prefetch
    cache.prefetch = lambda digest: cache.slot_of(digest) is not None or prefetch(digest)


def serve_pass(
    config: SlotSimConfig,
    measured: dict[str, dict[str, Any]],
    names: tuple[str, ...] = ORDER,
    seed: int | None = None,
    skips_resident: bool = False,
) -> dict[str, Any]:
    """The pass on one simulated engine: the offline pass, `names` over HTTP, then the
    reference (one adapter at the Poisson runs' rate)."""
    sim = SlotSimulation(config)
    if skips_resident:
        skip_resident_prefetch(sim)
    seeded = {} if seed is None else {"seed": seed}
    rows = {OFFLINE: serve_figures(sim, workload_of(measured[OFFLINE], **seeded), offline=True)}
    rows.update({name: serve_figures(sim, workload_of(measured[name], **seeded)) for name in names})
    rows[REFERENCE] = serve_figures(sim, workload_of(measured["poisson-1000"], num_adapters=1, **seeded))
    return rows


def measured_pass(run: str) -> dict[str, dict[str, Any]]:
    measured = load_measured(run)
    measured[OFFLINE] = load_offline(run)
    return measured


def step_model(http_ms: float, sampled_ms: float, mixed_token_ms: float) -> StepModel:
    base, per_row, per_adapter = fit_decode_line()
    return StepModel(
        base_ms=base + http_ms,
        per_decode_ms=per_row,
        per_adapter_ms=per_adapter,
        per_prefill_token_ms=StepModel.per_prefill_token_ms,
        per_sampled_token_ms=sampled_ms,
        eager_floor_ms=EAGER_FLOOR_MS,
        mixed_graph_tokens=MIXED_GRAPH_TOKENS,
        per_mixed_token_ms=mixed_token_ms,
    )


def calibrate_steps(config: SlotSimConfig, measured: dict[str, Any], log) -> tuple[SlotSimConfig, list[dict]]:
    """The grid against the one-adapter rate runs (fresh engine each: no loads, no
    preemptions), by rms relative error of mean TPOT and median ITL; then request_overhead_ms
    moved by the mean gap of their TTFT p50."""
    names = [f"rate-1-{f}" for f in RATE_FACTORS]
    grid = []
    for http, sampled, mixed in itertools.product(HTTP_BASE_MS, PER_SAMPLED_MS, PER_MIXED_TOKEN_MS):
        candidate = replace(config, step=step_model(http, sampled, mixed))
        errors, p50_gaps = [], []
        for name in names:
            sim = serve_figures(SlotSimulation(candidate), workload_of(measured[name]))
            errors += [sim[k] / measured[name][k] - 1 for k in ("tpot_mean_ms", "itl_p50_ms")]
            p50_gaps.append(measured[name]["ttft_p50_ms"] - sim["ttft_p50_ms"])
        grid.append(
            {
                "http_base_ms": http,
                "per_sampled_token_ms": sampled,
                "per_mixed_token_ms": mixed,
                "rms_error": round(float(np.sqrt(np.mean(np.square(errors)))), 4),
                "ttft_p50_gap_ms": round(float(np.mean(p50_gaps)), 1),
            }
        )
    grid.sort(key=lambda row: row["rms_error"])
    best = grid[0]
    log(f"step grid, best 5: {grid[:5]}")
    overhead = max(0.0, config.request_overhead_ms + best["ttft_p50_gap_ms"])
    step = step_model(best["http_base_ms"], best["per_sampled_token_ms"], best["per_mixed_token_ms"])
    return replace(config, step=step, request_overhead_ms=round(overhead, 1)), grid


def calibrate_loads(config: SlotSimConfig, measured: dict[str, Any], log) -> tuple[SlotSimConfig, list[dict]]:
    """The share of a host load that holds the engine, by the mean log error of p99 TTFT and
    throughput over the runs whose adapters start cold (the offline pass: throughput alone;
    poisson-1000; rate-1000-0.7), the pass served in order on one engine up to the last."""
    names = ORDER[:4]  # saturation-1000, poisson-1000, poisson-32, rate-1000-0.7
    cold = {OFFLINE: ("output_throughput",), **dict.fromkeys(COLD_RUNS, ("ttft_p99_ms", "output_throughput"))}
    grid = []
    for share in HOLDS_ENGINE:
        rows = serve_pass(replace(config, host_load_holds_engine=share), measured, names)
        logs = [abs(math.log(rows[n][k] / measured[n][k])) for n, keys in cold.items() for k in keys]
        grid.append(
            {
                "host_load_holds_engine": share,
                "mean_log_error": round(float(np.mean(logs)), 3),
                **{f"{n} {k}": rows[n][k] for n, keys in cold.items() for k in keys},
            }
        )
        log(f"holds {share}: {grid[-1]}")
    best = min(grid, key=lambda row: row["mean_log_error"])
    return replace(config, host_load_holds_engine=best["host_load_holds_engine"]), grid


def check(config: SlotSimConfig, measured: dict[str, Any], log) -> dict[str, Any]:
    """Every run of the pass, measured against simulated, and the errors of the main figures."""
    rows = serve_pass(config, measured)
    log("run             measured/simulated: TTFT p50, p99, TPOT mean, ITL p50, p99, tok/s, fairness pre.")
    for name in ORDER:
        log(
            compare_line(name, measured[name], rows[name])
            + f"  p90 {measured[name]['ttft_p90_ms']:7.0f}/{rows[name]['ttft_p90_ms']:7.0f}"
        )
    log(
        f"offline tok/s {measured[OFFLINE]['output_throughput']}/{rows[OFFLINE]['output_throughput']}, "
        f"preemptions {measured[OFFLINE]['preemptions']}/{rows[OFFLINE]['preemptions']}, host loads "
        f"{measured[OFFLINE]['host_loads']}/{rows[OFFLINE]['host_loads']}"
    )
    return rows


def errors(rows: dict[str, Any], measured: dict[str, Any]) -> dict[str, float]:
    """Simulated over measured, minus 1, for the figures the brief names."""
    out = {}
    for name in ("poisson-1000", "poisson-32"):
        for key in ("ttft_p99_ms", "ttft_p90_ms", "output_throughput", "fairness_preemptions", "itl_p50_ms"):
            out[f"{name} {key}"] = round(rows[name][key] / measured[name][key] - 1, 3)
    out["offline output_throughput"] = round(
        rows[OFFLINE]["output_throughput"] / measured[OFFLINE]["output_throughput"] - 1, 3
    )
    out["offline preemptions"] = round(rows[OFFLINE]["preemptions"] / measured[OFFLINE]["preemptions"] - 1, 3)
    out["saturation-1000 output_throughput"] = round(
        rows["saturation-1000"]["output_throughput"] / measured["saturation-1000"]["output_throughput"] - 1, 3
    )
    return out


def max_rate(rows: dict[str, Any], num_adapters: int, measured: dict[str, Any]) -> float | None:
    """The highest rate of the sweep with p99 TTFT under the target (the sweep's rates need not
    all pass: the serve report's reading)."""
    rates = [
        measured[f"rate-{num_adapters}-{f}"]["workload"]["request_rate"]
        for f in RATE_FACTORS
        if rows[f"rate-{num_adapters}-{f}"]["ttft_p99_ms"] < TTFT_TARGET_MS
    ]
    return max(rates, default=None)


def goals(rows: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    many, resident, one = rows["poisson-1000"], rows["poisson-32"], rows[REFERENCE]
    rate_many, rate_one = max_rate(rows, 1000, measured), max_rate(rows, 1, measured)
    out = {
        "ttft_p99_1000_ms": many["ttft_p99_ms"],
        "ttft_p99_ratio_to_1": round(many["ttft_p99_ms"] / one["ttft_p99_ms"], 2),
        "throughput_ratio_to_32": round(many["output_throughput"] / resident["output_throughput"], 3),
        "max_rate_1000": rate_many,
        "max_rate_1": rate_one,
        "max_rate_ratio": round((rate_many or 0.0) / rate_one, 3) if rate_one else None,
        "offline_over_http": round(
            rows[OFFLINE]["output_throughput"] / rows["saturation-1000"]["output_throughput"], 3
        ),
    }
    out["meets"] = {
        "ttft": out["ttft_p99_1000_ms"] <= TTFT_TARGET_MS and out["ttft_p99_ratio_to_1"] <= 2.0,
        "throughput": out["throughput_ratio_to_32"] >= 0.95,
        "max_rate": (out["max_rate_ratio"] or 0.0) >= 0.8,
        "offline": out["offline_over_http"] >= 1.0,
    }
    return out


def summary_line(name: str, rows: dict[str, Any], g: dict[str, Any] | None) -> str:
    r = rows
    return (
        f"{name:28s} p99/p90 TTFT 1000 "
        f"{r['poisson-1000']['ttft_p99_ms']:6.0f}/{r['poisson-1000']['ttft_p90_ms']:6.0f} "
        f"32 {r['poisson-32']['ttft_p99_ms']:6.0f}/{r['poisson-32']['ttft_p90_ms']:6.0f} "
        f"1 {r[REFERENCE]['ttft_p99_ms']:5.0f}/{r[REFERENCE]['ttft_p90_ms']:5.0f} | tok/s 1000/32/1 "
        f"{r['poisson-1000']['output_throughput']:5.0f}/{r['poisson-32']['output_throughput']:5.0f}/"
        f"{r[REFERENCE]['output_throughput']:5.0f} | fair pre. "
        f"{r['poisson-1000']['fairness_preemptions']}/{r['poisson-32']['fairness_preemptions']} | offline "
        f"{r[OFFLINE]['output_throughput']:5.0f} vs HTTP {r['saturation-1000']['output_throughput']:5.0f} "
        f"(pre. {r[OFFLINE]['preemptions']}/{r['saturation-1000']['preemptions']})"
        + (
            ""
            if g is None
            else " | rate-1000 p99 "
            + " ".join(f"{r[f'rate-1000-{f}']['ttft_p99_ms']:.0f}" for f in RATE_FACTORS)
            + f" | max rate 1000/1 {g['max_rate_1000']}/{g['max_rate_1']}"
        )
    )


def table(done: dict[str, Any]) -> str:
    """The sweep as a markdown table: seed 14's figures, then the medians over the seeds."""
    head = (
        "| setting | p99 / p90 TTFT 1000 | p99 / p90 TTFT 32 | p99 / p90 TTFT 1 | p99 ratio 1000/1 "
        "| tok/s ratio 1000/32 | fairness pre. 1000 / 32 | offline / HTTP tok/s (pre.) | rate-1000 sweep p99 "
        "| max rate 1000 / 1 | median over seeds 14-16: p99 1000, ratio, tok/s ratio, offline/HTTP |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, row in done.get("sweep", {}).items():
        r, g, m = row["runs"], row["goals"], row["goals"]["median_over_seeds"]
        cells = [
            name,
            f"{r['poisson-1000']['ttft_p99_ms']:.0f} / {r['poisson-1000']['ttft_p90_ms']:.0f}",
            f"{r['poisson-32']['ttft_p99_ms']:.0f} / {r['poisson-32']['ttft_p90_ms']:.0f}",
            f"{r[REFERENCE]['ttft_p99_ms']:.0f} / {r[REFERENCE]['ttft_p90_ms']:.0f}",
            f"{g['ttft_p99_ratio_to_1']:.1f}",
            f"{g['throughput_ratio_to_32']:.3f}",
            f"{r['poisson-1000']['fairness_preemptions']} / {r['poisson-32']['fairness_preemptions']}",
            f"{r[OFFLINE]['output_throughput']:.0f} / {r['saturation-1000']['output_throughput']:.0f} "
            f"({r[OFFLINE]['preemptions']} / {r['saturation-1000']['preemptions']})",
            " ".join(f"{r[f'rate-1000-{f}']['ttft_p99_ms']:.0f}" for f in RATE_FACTORS),
            f"{g['max_rate_1000']} / {g['max_rate_1']}",
            f"{m['poisson-1000 ttft_p99_ms']:.0f}, {m['ttft_p99_ratio_to_1']:.1f}, "
            f"{m['throughput_ratio_to_32']:.3f}, {m['offline_over_http']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def calibrated_config(done: dict[str, Any]) -> SlotSimConfig:
    c = done["calibration"]
    return SlotSimConfig(
        pool=True,
        step=StepModel(**c["step"]),
        request_overhead_ms=c["request_overhead_ms"],
        host_load_ms=c["host_load_ms"],
        host_load_holds_engine=c["host_load_holds_engine"],
        num_load_threads=c["num_load_threads"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("calibrate", "sweep", "table"))
    parser.add_argument("names", nargs="*", help="settings (SETTINGS' names, combined with '+')")
    parser.add_argument("--seeds", type=int, nargs="*", default=[15, 16], help="other workload seeds")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    done = json.loads(args.out.read_text()) if args.out.exists() else {}

    def log(line: str) -> None:
        print(line, flush=True)

    def save() -> None:
        args.out.write_text(json.dumps(done, indent=1, default=str) + "\n")

    if args.command == "table":
        print(table(done))
        return
    measured = measured_pass(RUN_3)
    if args.command == "calibrate":
        start = SlotSimConfig(pool=True, host_load_ms=HOST_LOAD_MS, num_load_threads=LOAD_THREADS)
        if args.names == ["loads"] and "calibration" in done:  # the step grid of the last run
            stepped, step_grid = calibrated_config(done), done["calibration"]["step_grid"]
            stepped = replace(stepped, host_load_ms=HOST_LOAD_MS, num_load_threads=LOAD_THREADS)
        else:
            stepped, step_grid = calibrate_steps(start, measured, log)
        log(f"== step: {stepped.step}, request overhead {stepped.request_overhead_ms} ms")
        config, load_grid = calibrate_loads(stepped, measured, log)
        log(f"== host loads: {config.host_load_ms} ms on {config.num_load_threads} threads, "
            f"holding the engine for {config.host_load_holds_engine} of each")
        rows = check(config, measured, log)
        done["calibration"] = {
            "step": config.step.__dict__,
            "request_overhead_ms": config.request_overhead_ms,
            "host_load_ms": config.host_load_ms,
            "host_load_holds_engine": config.host_load_holds_engine,
            "num_load_threads": config.num_load_threads,
            "step_grid": step_grid,
            "load_grid": load_grid,
        }
        done["check"] = {"runs": rows, "errors": errors(rows, measured), "goals": goals(rows, measured)}
        log(f"errors: {done['check']['errors']}")
        done["measured"] = measured
        save()
        return
    config = calibrated_config(done)
    for name in args.names or list(SETTINGS):
        setting = setting_config(config, name)
        skips = SKIPS_RESIDENT in name.split("+")
        rows = serve_pass(setting, measured, skips_resident=skips)
        g = goals(rows, measured)
        log(summary_line(name, rows, g))
        by_seed = {"14": {k: rows[k] for k in POISSON_RUNS}}
        for seed in args.seeds:
            seeded = serve_pass(setting, measured, ORDER[:3], seed=seed, skips_resident=skips)
            by_seed[str(seed)] = {k: seeded[k] for k in POISSON_RUNS}
            log(summary_line(f"{name} seed {seed}", seeded, None))
        g["median_over_seeds"] = {
            f"{n} {k}": float(np.median([r[n][k] for r in by_seed.values()]))
            for n in ("poisson-1000", "poisson-32", REFERENCE)
            for k in ("ttft_p99_ms", "ttft_p90_ms", "output_throughput", "fairness_preemptions")
        }
        for key, (top, bottom, figure) in RATIOS.items():
            g["median_over_seeds"][key] = round(
                float(np.median([r[top][figure] / r[bottom][figure] for r in by_seed.values()])), 3
            )
        done.setdefault("sweep", {})[name] = {"goals": g, "runs": rows, "seeds": by_seed}
        save()

if __name__ == "__main__":
    main()

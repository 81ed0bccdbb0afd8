"""The slot simulation (loraplex/benchmarks/slot_sim.py) calibrated to the H100 serving pass on
the device pool of 2026-11-28 (bench/results/serve-h100-pool-2026-11-28/, Llama-3-8B shape,
1,000 rank-16 adapters, no --max-loras, 128 running, 8,192 tokens a step, HTTP), then the
scheduler's knobs swept on it: scheduler_delay_factor, fairness_bound, hold_places_for_loading.
Last, the fairness simulation with the calibrated eager floor at the recommended settings.

1. Calibration. The decode line (base, a decode row, a distinct adapter) is fitted to the
   H100's decode graphs with one adapter a request and with none; the eager floor, the HTTP
   share of the base and the per-sampled-token cost by a grid to the five one-adapter rate runs
   of run 2 (mean TPOT and median ITL). The other runs of run 2 (poisson-32, poisson-1000, the
   1,000-adapter rate sweep) and run 1 (no delay) take no part in the fit; the simulation
   serves them in the order the benchmark did, on one engine (resident adapters and tenants'
   counters carry over).
2. The sweep: every setting serves that sequence again, with a one-adapter Poisson run at the
   poisson runs' rate (80% of the saturated rate) as the reference of the goals.
3. The fairness simulation at the recommended settings, seeds 0-2.

    PYTHONPATH=. python studies/serving_sim_pool.py   # about 10 minutes on one core

Writes studies/results/serving-sim-pool-h100.json and prints the tables of
studies/results/serving-sim-pool-h100.md."""

from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from loraplex.benchmarks.fairness_sim import GOALS, H100_OFFLINE_STEP, FairnessSimConfig
from loraplex.benchmarks.fairness_sim import simulate as simulate_fairness
from loraplex.benchmarks.fairness_workload import FairnessWorkload
from loraplex.benchmarks.serve_workload import WorkloadConfig
from loraplex.benchmarks.slot_sim import SlotSimConfig, SlotSimulation, StepModel

RESULTS_DIR = Path(__file__).parent / "results"
MEASURED_DIR = Path(__file__).parents[1] / "bench" / "results" / "serve-h100-pool-2026-11-28"
RUN_1, RUN_2 = "1-no-delay", "2-delay-unchecked-ops"
ORDER = (
    "saturation-1000",
    "poisson-1000",
    "poisson-32",
    *(f"rate-{n}-{f}" for f in ("0.7", "0.9", "1.1", "1.0", "1.25") for n in (1000, 1)),
)
"""The benchmark's runs in the order it served them (bench-progress.log)."""
RATE_FACTORS = ("0.7", "0.9", "1.0", "1.1", "1.25")
REFERENCE = "poisson-1"
"""Simulated only: one adapter at the poisson runs' rate, the goals' reference."""

# The H100's decode graphs (bench/results/decode-nvidia-h100-80gb-hbm3.json), ms.
DECODE_BATCHES = (1, 8, 32, 64, 128)
DECODE_ONE_ADAPTER_A_REQUEST = (6.59, 7.53, 8.96, 10.76, 14.79)
DECODE_NO_ADAPTER = (5.83, 6.58, 7.32, 8.16, 10.23)
EAGER_STEP_MS = (42.6, 48.2, 53.8)
"""32 decodes and a 256-token prompt, 64 rank-16 adapters: 42.6 ms (53.8 on a slower host)."""
MEASURED_EAGER_STEP_MS = 42.6
"""The floor the calibration keeps: the grid's rms error hardly depends on it (see the grid)."""
HTTP_BASE_MS = (0.0, 1.0, 2.0, 3.0, 4.0)
PER_SAMPLED_MS = (0.0, 0.025, 0.05, 0.075, 0.10)

HOST_LOAD_MS = 110.0
"""The loader thread's CPU time a host load in the load-heavy runs of run 2 (poisson-1000: 21.1 s
for 192 loads; rate-1000-0.7: 9.3 s for 86; 140 to 210 ms in the runs with few loads)."""
HOLDS_ENGINE = (0.0, 0.5, 0.75, 1.0)

DELAY_FACTORS = (0.0, 0.5, 1.0, 2.0)
FAIRNESS_BOUNDS = (4096.0, 16384.0, 65536.0)
TTFT_TARGET_MS = 1000.0


def fit_decode_line() -> tuple[float, float, float]:
    """(base, per decode row, per distinct adapter) in ms by least squares over both curves:
    y = base + row x rows + adapter x adapters (+ a fixed cost of having adapters at all, folded
    into the base, since every request of the serving runs has one)."""
    x = np.array(DECODE_BATCHES, dtype=float)
    design = np.concatenate(
        [
            np.stack([np.ones_like(x), np.ones_like(x), x, x], axis=1),  # one adapter a request
            np.stack([np.ones_like(x), np.zeros_like(x), x, np.zeros_like(x)], axis=1),  # no adapter
        ]
    )
    y = np.array(DECODE_ONE_ADAPTER_A_REQUEST + DECODE_NO_ADAPTER)
    (base, lora_fixed, per_row, per_adapter), *_ = np.linalg.lstsq(design, y, rcond=None)
    return float(base + lora_fixed), float(per_row), float(per_adapter)


def load_measured(run: str) -> dict[str, dict[str, Any]]:
    measured = {}
    for name in ORDER:
        data = json.loads((MEASURED_DIR / run / f"serve-{name}.json").read_text())
        engine = data["engine"]
        measured[name] = {
            "workload": data["workload"],
            "ttft_p50_ms": data["ttft_ms"]["p50"],
            "ttft_p90_ms": data["ttft_ms"]["p90"],
            "ttft_p99_ms": data["ttft_ms"]["p99"],
            "tpot_mean_ms": data["tpot_ms"]["mean"],
            "itl_p50_ms": data["itl_ms"]["p50"],
            "itl_p99_ms": data["itl_ms"]["p99"],
            "output_throughput": data["output_throughput"],
            "preemptions": engine["preemptions"],
            "fairness_preemptions": engine.get("fairness_preemptions", engine["preemptions"]),
            "slot_loads": engine["adapter_slot_loads"],
        }
    return measured


def workload_of(measured: dict[str, Any], **changes: Any) -> WorkloadConfig:
    workload = dict(measured["workload"], **changes)
    return WorkloadConfig(
        **{
            k: (math.inf if v in (None, "inf", "Infinity") else v) if k == "request_rate" else v
            for k, v in workload.items()
        }
    )


def serve_figures(sim: SlotSimulation, workload: WorkloadConfig, *, offline: bool = False) -> dict[str, Any]:
    """One run on `sim` with what the HTTP benchmark reports, and TTFT p99 of the requests
    that were never preempted (to see whether preemptions make the tail)."""
    run = sim.run(workload, offline=offline)
    gaps = np.concatenate([np.diff(t.token_s) for t in sim.timings.values()]) * 1000
    ttft = {rid: (t.first_token_s - t.arrival_s) * 1000 for rid, t in sim.timings.items()}
    untouched = [ms for rid, ms in ttft.items() if sim.requests[rid].num_preemptions == 0]
    return {
        "ttft_p50_ms": run["ttft_ms"]["p50"],
        "ttft_p90_ms": run["ttft_ms"]["p90"],
        "ttft_p99_ms": run["ttft_ms"]["p99"],
        "tpot_mean_ms": run["tpot_ms"]["mean"],
        "itl_p50_ms": round(float(np.percentile(gaps, 50)), 2),
        "itl_p99_ms": round(float(np.percentile(gaps, 99)), 2),
        "output_throughput": run["output_throughput"],
        "preemptions": run["preemptions"],
        "fairness_preemptions": run["fairness_preemptions"],
        "slot_loads": run["adapter_slot_loads"],
        "host_loads": run["adapter_host_loads"],
        "ttft_p99_never_preempted_ms": round(float(np.percentile(untouched, 99)), 1) if untouched else None,
        "num_preempted_requests": len(ttft) - len(untouched),
    }


def serve_sequence(
    config: SlotSimConfig,
    measured: dict[str, dict[str, Any]],
    names: tuple[str, ...] = ORDER,
    seed: int | None = None,
) -> dict[str, Any]:
    """`names` served one after another on one simulated engine, then the reference run."""
    sim = SlotSimulation(config)
    seeded = {} if seed is None else {"seed": seed}
    rows = {name: serve_figures(sim, workload_of(measured[name], **seeded)) for name in names}
    rows[REFERENCE] = serve_figures(sim, workload_of(measured["poisson-1000"], num_adapters=1, **seeded))
    return rows


def calibrate(config: SlotSimConfig, measured: dict[str, dict[str, Any]]) -> tuple[StepModel, list[dict]]:
    """The grid over (eager floor, HTTP base, per sampled token) against the one-adapter rate
    runs' mean TPOT and median ITL, each run on a fresh engine; the best by rms relative error."""
    device_base, per_row, per_adapter = fit_decode_line()
    names = [f"rate-1-{f}" for f in RATE_FACTORS]
    grid = []
    for floor, http, sampled in itertools.product(EAGER_STEP_MS, HTTP_BASE_MS, PER_SAMPLED_MS):
        step = StepModel(
            base_ms=device_base + http,
            per_decode_ms=per_row,
            per_adapter_ms=per_adapter,
            per_prefill_token_ms=StepModel.per_prefill_token_ms,
            per_sampled_token_ms=sampled,
            eager_floor_ms=floor,
        )
        errors = []
        for name in names:
            sim = serve_figures(SlotSimulation(replace(config, step=step)), workload_of(measured[name]))
            errors += [sim[k] / measured[name][k] - 1 for k in ("tpot_mean_ms", "itl_p50_ms")]
        grid.append(
            {
                "eager_floor_ms": floor,
                "http_base_ms": http,
                "per_sampled_token_ms": sampled,
                "rms_error": round(float(np.sqrt(np.mean(np.square(errors)))), 4),
                "step": step,
            }
        )
    grid.sort(key=lambda row: row["rms_error"])
    best = next(row for row in grid if row["eager_floor_ms"] == MEASURED_EAGER_STEP_MS)
    return best["step"], [{k: v for k, v in row.items() if k != "step"} for row in grid]


def calibrate_loads(
    config: SlotSimConfig, measured: dict[str, dict[str, Any]]
) -> tuple[SlotSimConfig, list[dict]]:
    """host_load_ms from the loader thread's CPU; the share of a load that holds the engine
    fitted to poisson-1000 alone (p99 TTFT and throughput, log errors)."""
    grid = []
    for share in HOLDS_ENGINE:
        candidate = replace(config, host_load_ms=HOST_LOAD_MS, host_load_holds_engine=share)
        sim = serve_sequence(candidate, measured, ORDER[:2])["poisson-1000"]
        error = sum(
            abs(math.log(sim[k] / measured["poisson-1000"][k])) for k in ("ttft_p99_ms", "output_throughput")
        )
        grid.append(
            {
                "host_load_holds_engine": share,
                "error": round(error, 3),
                "ttft_p99_ms": sim["ttft_p99_ms"],
                "output_throughput": sim["output_throughput"],
                "config": candidate,
            }
        )
    best = min(grid, key=lambda row: row["error"])
    return best["config"], [{k: v for k, v in row.items() if k != "config"} for row in grid]


def max_rate_under_target(
    rows: dict[str, Any], num_adapters: int, measured: dict[str, dict[str, Any]]
) -> float | None:
    """The highest rate of the sweep below its first rate whose p99 TTFT misses the target."""
    best = None
    for f in RATE_FACTORS:
        name = f"rate-{num_adapters}-{f}"
        if rows[name]["ttft_p99_ms"] >= TTFT_TARGET_MS:
            break
        best = measured[name]["workload"]["request_rate"]
    return best


def goals(rows: dict[str, Any]) -> dict[str, Any]:
    many, one = rows["poisson-1000"], rows[REFERENCE]
    ratio = many["ttft_p99_ms"] / one["ttft_p99_ms"]
    throughput = many["output_throughput"] / one["output_throughput"]
    return {
        "ttft_p99_1000_ms": many["ttft_p99_ms"],
        "ttft_p99_1_ms": one["ttft_p99_ms"],
        "ttft_p99_ratio": round(ratio, 2),
        "throughput_ratio": round(throughput, 3),
        "meets": many["ttft_p99_ms"] <= TTFT_TARGET_MS and ratio <= 2.0,
    }


def sweep(config: SlotSimConfig, measured: dict[str, dict[str, Any]], log) -> list[dict[str, Any]]:
    settings = [
        {"policy": "vtc", "scheduler_delay_factor": d, "fairness_bound": b, "hold_places_for_loading": h}
        for d, b, h in itertools.product(DELAY_FACTORS, FAIRNESS_BOUNDS, (False, True))
    ]
    settings += [
        {
            "policy": "fcfs",
            "scheduler_delay_factor": d,
            "fairness_bound": 4096.0,
            "hold_places_for_loading": False,
        }
        for d in DELAY_FACTORS
    ]
    results = []
    for setting in settings:
        rows = serve_sequence(replace(config, **setting), measured)
        row = {
            **setting,
            "goals": goals(rows),
            "max_rate_p99_under_1s": {n: max_rate_under_target(rows, n, measured) for n in (1000, 1)},
            "runs": rows,
        }
        results.append(row)
        log(f"{_setting(setting):32s} " + _sweep_line(row))
    return results


def robustness(
    config: SlotSimConfig,
    measured: dict[str, dict[str, Any]],
    settings: list[dict[str, Any]],
    seeds: tuple[int, ...],
    log,
) -> list[dict[str, Any]]:
    """poisson-1000, -32 and the one-adapter reference on other workload seeds (fresh engine
    after a saturation run, as in the benchmark)."""
    out = []
    for setting, seed in itertools.product(settings, seeds):
        rows = serve_sequence(replace(config, **setting), measured, ORDER[:3], seed=seed)
        out.append(
            {
                **setting,
                "seed": seed,
                "goals": goals(rows),
                "runs": {k: rows[k] for k in ("poisson-1000", "poisson-32", REFERENCE)},
            }
        )
        g = goals(rows)
        log(
            f"{_setting(setting):32s} seed {seed}: p99 TTFT 1000/32/1 "
            f"{rows['poisson-1000']['ttft_p99_ms']:7.0f} "
            f"{rows['poisson-32']['ttft_p99_ms']:7.0f} {rows[REFERENCE]['ttft_p99_ms']:6.0f} ms, ratio "
            f"{g['ttft_p99_ratio']:5.2f}, throughput ratio {g['throughput_ratio']:.3f}, fairness preemptions "
            f"{rows['poisson-1000']['fairness_preemptions']}/{rows['poisson-32']['fairness_preemptions']}"
        )
    return out


def without_load_stall(
    config: SlotSimConfig, measured: dict[str, dict[str, Any]], log
) -> list[dict[str, Any]]:
    """The poisson runs (after the saturation run, as in the benchmark) with host loads that do
    not hold the engine (host_load_holds_engine 0), every setting of the sweep and FCFS."""
    settings = [
        {"policy": "vtc", "scheduler_delay_factor": d, "fairness_bound": b, "hold_places_for_loading": h}
        for d, b, h in itertools.product(DELAY_FACTORS, FAIRNESS_BOUNDS, (False, True))
    ]
    settings += [
        {
            "policy": "fcfs",
            "scheduler_delay_factor": d,
            "fairness_bound": 4096.0,
            "hold_places_for_loading": False,
        }
        for d in DELAY_FACTORS
    ]
    out = []
    for setting in settings:
        rows = serve_sequence(replace(config, host_load_holds_engine=0.0, **setting), measured, ORDER[:3])
        out.append(
            {
                **setting,
                "goals": goals(rows),
                "runs": {k: rows[k] for k in ("poisson-1000", "poisson-32", REFERENCE)},
            }
        )
        r = rows
        log(
            f"{_setting(setting):32s} p99 TTFT 1000/32/1 {r['poisson-1000']['ttft_p99_ms']:7.0f} "
            f"{r['poisson-32']['ttft_p99_ms']:7.0f} {r[REFERENCE]['ttft_p99_ms']:6.0f} ms, tok/s "
            f"{r['poisson-1000']['output_throughput']:5.0f} {r['poisson-32']['output_throughput']:5.0f} "
            f"{r[REFERENCE]['output_throughput']:5.0f}, fairness preemptions "
            f"{r['poisson-1000']['fairness_preemptions']} "
            f"{r['poisson-32']['fairness_preemptions']}"
        )
    return out


def fairness_check(
    step: StepModel, settings: list[dict[str, Any]], seeds: tuple[int, ...], log
) -> list[dict[str, Any]]:
    """The fairness simulation (its offline H100 step model) with the calibrated eager floor."""
    out = []
    for setting, seed in itertools.product(settings, seeds):
        config = FairnessSimConfig(
            workload=FairnessWorkload(seed=seed),
            fairness_bound=setting["fairness_bound"],
            scheduler_delay_factor=setting["scheduler_delay_factor"],
            step=replace(H100_OFFLINE_STEP, eager_floor_ms=step.eager_floor_ms),
        )
        summary = simulate_fairness(config)["summary"]
        out.append({**setting, "seed": seed, "summary": summary})
        log(f"{_setting(setting):32s} seed {seed}: {json.dumps(summary)}")
    return out


def _setting(s: dict[str, Any]) -> str:
    return (
        f"{s['policy']} delay {s['scheduler_delay_factor']:g} bound {s['fairness_bound']:g}"
        f"{' hold' if s['hold_places_for_loading'] else ''}"
    )


def _sweep_line(row: dict[str, Any]) -> str:
    r, g = row["runs"], row["goals"]
    return (
        f"p99 TTFT 1000/32/1 {r['poisson-1000']['ttft_p99_ms']:7.0f} {r['poisson-32']['ttft_p99_ms']:7.0f} "
        f"{r[REFERENCE]['ttft_p99_ms']:6.0f} ms (ratio {g['ttft_p99_ratio']:5.2f}), tok/s "
        f"{r['poisson-1000']['output_throughput']:5.0f} {r['poisson-32']['output_throughput']:5.0f} "
        f"{r[REFERENCE]['output_throughput']:5.0f}, fairness preemptions "
        f"{r['poisson-1000']['fairness_preemptions']:3d} "
        f"{r['poisson-32']['fairness_preemptions']:3d}, sweep p99 TTFT 1000: "
        + " ".join(f"{r[f'rate-1000-{f}']['ttft_p99_ms']:.0f}" for f in RATE_FACTORS)
        + " 1: "
        + " ".join(f"{r[f'rate-1-{f}']['ttft_p99_ms']:.0f}" for f in RATE_FACTORS)
        + f", max rate < 1 s: {row['max_rate_p99_under_1s']}"
    )


def compare_line(name: str, measured: dict[str, Any], simulated: dict[str, Any]) -> str:
    keys = (
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tpot_mean_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "output_throughput",
        "fairness_preemptions",
    )
    return f"{name:16s} " + "  ".join(f"{measured[k]:7.1f}/{simulated[k]:7.1f}" for k in keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[15, 16, 17],
        help="other workload seeds for the recommended settings",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "serving-sim-pool-h100.json")
    parser.add_argument(
        "--only-extra",
        action="store_true",
        help="from the last full run's calibration (--out): the sweep's poisson runs with "
        "loads that do not hold the engine, and the fairness simulation at more settings",
    )
    args = parser.parse_args()
    if args.only_extra:
        done = json.loads(args.out.read_text())
        step = StepModel(**done["step"])
        config = SlotSimConfig(pool=True, step=step, host_load_ms=done["host_load_ms"])
        done["without_load_stall"] = without_load_stall(config, load_measured(RUN_2), print)
        vtc = [
            {
                "policy": "vtc",
                "scheduler_delay_factor": d,
                "fairness_bound": b,
                "hold_places_for_loading": False,
            }
            for d, b in itertools.product((0.5, 1.0), FAIRNESS_BOUNDS)
        ]
        done["fairness_more"] = fairness_check(step, vtc, (0, 1, 2), print)
        args.out.write_text(json.dumps(done, indent=1, default=str) + "\n")
        return

    def log(line: str) -> None:
        print(line, flush=True)

    base = SlotSimConfig(pool=True)  # the H100 server's engine: 32 slots' worth beside the KV cache
    measured = {run: load_measured(run) for run in (RUN_1, RUN_2)}
    device_base, per_row, per_adapter = fit_decode_line()
    log(f"== decode line: {device_base:.2f} ms + {per_row:.4f} ms a row + {per_adapter:.4f} ms an adapter")
    step, grid = calibrate(base, measured[RUN_2])
    log(f"== calibrated: {step} (best 5 of the grid: {grid[:5]})")
    stepped = replace(base, step=step)
    config, load_grid = calibrate_loads(stepped, measured[RUN_2])
    log(
        f"== host loads: {HOST_LOAD_MS} ms, holding the engine for {config.host_load_holds_engine} of it "
        f"(grid: {load_grid})"
    )

    log("== check: measured/simulated  TTFT p50, p99, TPOT mean, ITL p50, p99, tok/s, fairness preemptions")
    checks = {}
    for label, run, cfg in (
        ("default model, run 2", RUN_2, base),
        ("calibrated steps, default loads, run 2", RUN_2, stepped),
        ("calibrated, run 2", RUN_2, config),
        ("calibrated, run 1 (delay 0)", RUN_1, replace(config, scheduler_delay_factor=0.0)),
    ):
        rows = serve_sequence(cfg, measured[run])
        checks[label] = rows
        log(f"-- {label}")
        for name in ORDER[1:]:
            log(compare_line(name, measured[run][name], rows[name]))

    log("== sweep (run 2's runs, calibrated model)")
    swept = sweep(config, measured[RUN_2], log)
    chosen = [row for row in swept if row["goals"]["meets"]]
    recommended = sorted(chosen or swept, key=lambda r: r["goals"]["ttft_p99_1000_ms"])[:3]
    keys = ("policy", "scheduler_delay_factor", "fairness_bound", "hold_places_for_loading")
    picked = [{k: row[k] for k in keys} for row in recommended]
    default = {
        "policy": "vtc",
        "scheduler_delay_factor": 1.0,
        "fairness_bound": 4096.0,
        "hold_places_for_loading": False,
    }
    log("== other workload seeds")
    robust = robustness(config, measured[RUN_2], [default, *picked], tuple(args.seeds), log)
    log("== fairness simulation, calibrated eager floor")
    fair = fairness_check(step, [default, *[p for p in picked if p["policy"] == "vtc"]], (0, 1, 2), log)
    result = {
        "study": "serving-sim-pool",
        "device": "simulated H100 (calibrated to 2026-11-28)",
        "decode_line": {"base_ms": device_base, "per_decode_ms": per_row, "per_adapter_ms": per_adapter},
        "step": step.__dict__,
        "calibration_grid": grid,
        "load_grid": load_grid,
        "host_load_ms": config.host_load_ms,
        "host_load_holds_engine": config.host_load_holds_engine,
        "checks": checks,
        "measured": measured,
        "sweep": swept,
        "recommended": picked,
        "other_seeds": robust,
        "fairness": fair,
        "fairness_goals": GOALS,
    }
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()

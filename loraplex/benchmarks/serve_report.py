"""The serving benchmark's goals, read from the JSON that `scripts/gpu-serving.sh` leaves (one
file per run of `loraplex bench serve`, and the synthetic server's offline pass):

- 1,000 adapters against 32 resident ones at the same Poisson rate: output throughput within 5%,
  p99 TTFT within 2x; cold loads move p99 ITL by less than 10%;
- issue 27's own terms, at 80% of the one-adapter saturated rate: 1,000 adapters' p99 TTFT at
  most 1 s and 2x one adapter's at that rate, and their throughput at least 0.95x the same run
  again (its adapters loaded by the first);
- HTTP at saturation against the offline engine on the same requests: at least 90%; the server's
  CPU time per generated token;
- the highest rate tried at which p99 TTFT stays under 1 s, with 1,000 adapters and with one;
- device bytes per resident adapter by rank (the synthetic server's adapter-device-bytes.json:
  with mixed ranks, device bytes per rank unit should be the same for every rank).

    python -m loraplex.benchmarks.serve_report DIR [--plot]

Writes DIR/serve-summary.json and prints it; with --plot (matplotlib) also the plots of every
run and DIR/serve-rates.png (p99 TTFT against rate)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

TTFT_LIMIT_MS = 1000.0
DEVICE_BYTES_FILE = "adapter-device-bytes.json"
"""The synthetic server's device bytes per resident adapter by rank, in the results folder."""


def _load(folder: Path, name: str) -> dict[str, Any] | None:
    path = folder / name
    return json.loads(path.read_text()) if path.is_file() else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def summarize(folder: Path) -> dict[str, Any]:
    many, resident = _load(folder, "serve-poisson-1000.json"), _load(folder, "serve-poisson-32.json")
    saturated = _load(folder, "serve-saturation-1000.json")
    offline = next((json.loads(p.read_text()) for p in sorted(folder.glob("serve-offline-*.json"))), None)
    summary: dict[str, Any] = {}
    if many and resident:
        summary["many_vs_resident"] = {
            "rate": many["workload"]["request_rate"],
            "output_throughput": [many["output_throughput"], resident["output_throughput"]],
            "throughput_ratio": _ratio(many["output_throughput"], resident["output_throughput"]),
            "ttft_p99_ms": [many["ttft_ms"]["p99"], resident["ttft_ms"]["p99"]],
            "ttft_p99_ratio": _ratio(many["ttft_ms"]["p99"], resident["ttft_ms"]["p99"]),
            "itl_p99_ms": [many["itl_ms"]["p99"], resident["itl_ms"]["p99"]],
            "itl_p99_ratio": _ratio(many["itl_ms"]["p99"], resident["itl_ms"]["p99"]),
            "cold_loads": [many["engine"]["adapter_host_loads"], resident["engine"]["adapter_host_loads"]],
            "goals": "throughput ratio >= 0.95, TTFT p99 ratio <= 2, ITL p99 ratio < 1.10",
        }
    one, cold, again = (_load(folder, f"serve-issue-{name}.json") for name in ("1", "1000", "1000-again"))
    if one and cold:
        summary["issue_27"] = issue_27(one, cold, again)
    if saturated and offline:
        summary["http_vs_offline"] = http_vs_offline(saturated, offline)
    for adapters in ("1000", "1"):
        runs = sorted((json.loads(p.read_text()) for p in folder.glob(f"serve-rate-{adapters}-*.json")),
                      key=lambda r: float(r["workload"]["request_rate"]))
        if not runs:
            continue
        table = [{"rate": float(r["workload"]["request_rate"]), "ttft_p99_ms": r["ttft_ms"]["p99"],
                  "output_throughput": r["output_throughput"], "failed": r["failed"]} for r in runs]
        within = [row["rate"] for row in table if row["ttft_p99_ms"] is not None
                  and row["ttft_p99_ms"] < TTFT_LIMIT_MS and not row["failed"]]
        summary[f"max_rate_ttft_p99_under_1s_{adapters}_adapters"] = {
            "max_rate_tried_within": max(within, default=None),
            "is_lower_bound": bool(within) and max(within) == table[-1]["rate"], "runs": table}
    device_bytes = _load(folder, DEVICE_BYTES_FILE)
    if device_bytes:
        summary["device_bytes_by_rank"] = {name: device_bytes[name]
                                           for name in ("when", "pool_page_bytes", "by_rank")}
    return summary


def issue_27(one: dict[str, Any], cold: dict[str, Any], again: dict[str, Any] | None) -> dict[str, Any]:
    """1,000 adapters at 80% of the one-adapter saturated rate against one adapter at that rate,
    and against the same 1,000-adapter run again (`again`: its adapters loaded by the first)."""
    runs = {"one adapter": one, "1,000 adapters": cold, "1,000 adapters again": again}
    p99 = {name: run["ttft_ms"]["p99"] for name, run in runs.items() if run}
    throughput = {name: run["output_throughput"] for name, run in runs.items() if run}
    ratio_to_one = _ratio(p99["1,000 adapters"], p99["one adapter"])
    result = {
        "rate": cold["workload"]["request_rate"], "ttft_p99_ms": p99, "output_throughput": throughput,
        "ttft_p99_vs_one_adapter": ratio_to_one,
        "throughput_vs_again": _ratio(throughput["1,000 adapters"], throughput.get("1,000 adapters again")),
        "cold_loads": {name: run["engine"].get("adapter_host_loads") for name, run in runs.items() if run},
        "fairness_preemptions": {name: run["engine"].get("fairness_preemptions")
                                 for name, run in runs.items() if run},
        "goals": "1,000 adapters: p99 TTFT <= 1,000 ms and <= 2x one adapter's; throughput >= 0.95x again",
    }
    result["met"] = (p99["1,000 adapters"] is not None and p99["1,000 adapters"] <= TTFT_LIMIT_MS
                     and ratio_to_one is not None and ratio_to_one <= 2.0
                     and (result["throughput_vs_again"] or 0.0) >= 0.95)
    return result


THREAD_FIGURES = ("engine_thread_cpu_ms_per_token", "event_loop_cpu_ms_per_token",
                  "other_threads_cpu_ms_per_token")


def total_cpu_ms_per_token(engine: dict[str, Any]) -> float | None:
    """The CPU of everything serving a generated token: the server's process and, where the engine
    runs in one of its own, that one's (the three thread figures add up to it either way); the
    server's process alone where the split is missing (an engine thread then counts in it)."""
    parts = [engine.get(name) for name in THREAD_FIGURES]
    if all(isinstance(part, (int, float)) for part in parts):
        return round(sum(parts), 4)
    return engine.get("server_cpu_ms_per_token")


def http_vs_offline(saturated: dict[str, Any], offline: dict[str, Any]) -> dict[str, Any]:
    """A saturation run through HTTP against the offline engine on the same requests: throughput
    and CPU per generated token (the server's by thread where it reports them)."""
    engine = saturated["engine"]
    return {
        "http_output_throughput": saturated["output_throughput"],
        "offline_output_throughput": offline["output_throughput"],
        "ratio": _ratio(saturated["output_throughput"], offline["output_throughput"]),
        "server_cpu_ms_per_token": engine["server_cpu_ms_per_token"],
        "offline_engine_cpu_ms_per_token": offline["engine_cpu_ms_per_token"],
        "http_preemptions": engine["preemptions"], "offline_preemptions": offline["preemptions"],
        "http_fairness_preemptions": engine.get("fairness_preemptions"),
        "offline_preemptions_by_cause": offline.get("preemptions_by_cause"),
        "offline_warm_up": offline.get("warm_up"),
        **{name: engine[name] for name in THREAD_FIGURES if name in engine},
        "total_cpu_ms_per_token": total_cpu_ms_per_token(engine),
        "load_average_1min_before": saturated.get("load_average_1min_before"),
        "goal": "ratio >= 0.90",
    }


def record_overhead(folder: Path, path: Path, label: str) -> dict[str, Any]:
    """Each `pair-*` folder's HTTP run (`serve-overhead.json`) against its own offline pass (one
    server start each, so that the two ran close in time, under the same load), and the
    medians, written into `path` (a JSON of such entries by label, kept across calls) as `label`."""
    import os
    import platform
    import statistics
    import subprocess

    runs = []
    for pair in sorted(folder.glob("pair-*")):
        offline = next(json.loads(p.read_text()) for p in pair.glob("serve-offline-*.json"))
        runs.append(http_vs_offline(_load(pair, "serve-overhead.json"), offline))
    medians = {name: round(statistics.median(run[name] for run in runs), 4) for name in runs[0]
               if isinstance(runs[0][name], (int, float)) and all(run[name] is not None for run in runs)}
    source = Path(__file__).resolve().parents[2]  # the code that ran: its commit
    git = ["git", "-C", str(source)]
    commit = subprocess.run([*git, "describe", "--always"], capture_output=True, text=True).stdout.strip()
    status = subprocess.run([*git, "status", "--porcelain", "--", "loraplex"], capture_output=True, text=True)
    if status.stdout:
        commit += "-modified"  # the code, not the results file this writes
    entry = {"commit": commit, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
             "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
             "workload": offline["workload"], "median": medians, "runs": runs}
    results = json.loads(path.read_text()) if path.is_file() else {}
    results[label] = entry
    path.write_text(json.dumps(results, indent=1) + "\n")
    return entry


def plot_rates(folder: Path, summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for adapters in ("1000", "1"):
        entry = summary.get(f"max_rate_ttft_p99_under_1s_{adapters}_adapters")
        if entry:
            ax.plot([r["rate"] for r in entry["runs"]], [r["ttft_p99_ms"] for r in entry["runs"]], marker="o",
                    label=f"{adapters} adapter{'s' if adapters != '1' else ''}")
    ax.axhline(TTFT_LIMIT_MS, color="k", linestyle="--", linewidth=1, label="1 s")
    ax.set_yscale("log")
    ax.set_xlabel("request rate (Poisson, requests/s)")
    ax.set_ylabel("p99 time to first token (ms)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--plot", action="store_true")
    parser.add_argument("--record-overhead", type=Path, metavar="FILE", help="instead: the HTTP "
                        "runs of the folder's pair-* folders against their offline passes, into FILE "
                        "under --label")
    parser.add_argument("--label", default="latest")
    args = parser.parse_args(argv)
    if args.record_overhead is not None:
        print(json.dumps(record_overhead(args.folder, args.record_overhead, args.label), indent=1))
        return 0
    summary = summarize(args.folder)
    (args.folder / "serve-summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    if args.plot:
        from loraplex.benchmarks.serve_bench import plot

        for path in sorted(args.folder.glob("serve-*.json")):
            result = json.loads(path.read_text())
            if result.get("benchmark") == "serve":
                plot(result, path.with_suffix(".png"))
        plot_rates(args.folder, summary, args.folder / "serve-rates.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

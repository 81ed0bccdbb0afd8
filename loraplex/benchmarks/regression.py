"""`loraplex bench regression`: the headline benchmarks at reduced size (decode, fairness, adapter
families, relay, serving), each figure against the one recorded for this device, in one pass
that fits a device call (scripts/gpu-regress.sh): about 8 minutes on an H100, install excluded.

Each stage runs as its own process (`python -m loraplex.benchmarks ...`, so a crash or a stage
past its time limit costs only that stage) with a limit of its own and of what the budget has
left; a stage that no longer fits is skipped, and says so. The figures (regression_figures.py:
ratios and fractions of floor where the benchmark has them) are compared with the last accepted
reduced-size pass for the device (bench/results/regression-<device>.json, when it ran the stage
with the same arguments), else with the full-size results recorded for the device
(decode-<device>.json, ...). The table says which record each figure used. The pass writes its
figures to <out>/regression-<device>.json (with the commit and the device): commit it to
bench/results/ as the next passes' record when its figures are accepted.

Exit status 1 when a figure MOVED beyond its tolerance, missed its goal, or a stage failed or ran
out of time; skipped stages do not fail the pass. `--smoke` runs the same on the CPU with a tiny
model (a check of the pass itself, about a minute)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.benchmarks import regression_figures as rf
from loraplex.benchmarks import regression_serving
from loraplex.benchmarks.regression_serving import ServingSizes
from loraplex.benchmarks.results import RESULTS, code_commit

ROOT = Path(__file__).resolve().parents[2]
TINY = json.dumps({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 3000})


@dataclass(frozen=True)
class Stage:
    name: str
    argv: tuple[str, ...]
    """`python -m loraplex.benchmarks` arguments, --out aside."""
    result_glob: str
    """Its result JSON in its folder."""
    expected_s: float
    """About what it takes on a fresh H100 (Triton compiles included): it starts only if the
    budget has this much left."""
    max_s: float
    """Its time limit."""


@dataclass(frozen=True)
class PassPlan:
    """The stages, the serving stage's sizes, and the rows the figures read."""

    stages: tuple[Stage, ...]
    serving: ServingSizes
    selection: rf.Selection
    device: str
    has_goals: bool = True
    """False: goals are not applied (they are the GPU's; a CPU smoke run checks the pass)."""

    def argv(self) -> dict[str, list[str]]:
        """What each stage runs with: a record is compared with only by a pass that ran the same."""
        return {stage.name: self.serving.argv() if stage.name == "serving" else list(stage.argv)
                for stage in self.stages}


REDUCED = PassPlan(
    stages=(
        # The decode benchmark's own sizes, two batches of five: batch 1 (the warm-up runs at 64).
        Stage("decode", ("decode", "--batch-sizes", "1,64", "--hf-batch-sizes", "", "--prompt-len", "512",
                         "--new-tokens", "128"), "decode-*.json", 75, 120),
        # Half the arrivals of the full run (30 s + 15 s drain): three runs of 23 s. 140 s cut it at
        # 286cd07 in its VTC run (the engine's build and the first runs took 120 s on a fresh H100).
        Stage("fairness", ("fairness", "--duration-s", "15", "--drain-s", "8"), "fairness-*.json", 140, 190),
        Stage("families", ("decode-families", "--batch-sizes", "1,16", "--crossover-ranks", "4",
                           "--prompt-len", "256", "--new-tokens", "48"), "decode-families-*.json", 90, 130),
        Stage("relay", ("relay", "--batches", "128", "--system-lens", "2048", "--new-tokens", "64"),
              "relay-*.json", 60, 100),
        Stage("serving", (), "serve-summary.json", 110, 160),
    ),
    serving=ServingSizes(
        server=("--num-adapters", "1000", "--num-tenants", "40", "--rank", "16", "--max-loras", "32",
                "--max-num-seqs", "128", "--max-num-batched-tokens", "8192", "--max-model-len", "4096"),
        workload=(("num_prompts", 300), ("num_tenants", 40), ("num_adapters", 1000), ("prompt_len", 256),
                  ("prompt_dist", "longtail"), ("max_prompt_len", 1024), ("output_len", 128),
                  ("zipf_alpha", 1.0), ("seed", 14))),
    selection=rf.Selection(),
    device="cuda",
)

_CPU = ("--device", "cpu")
SMOKE = PassPlan(
    stages=(
        Stage("decode", ("decode", "--batch-sizes", "1,4", "--hf-batch-sizes", "", "--prompt-len", "16",
                         "--new-tokens", "6", "--rank", "4", "--model-overrides", TINY, *_CPU),
              "decode-*.json", 20, 60),
        Stage("fairness", ("fairness", "--duration-s", "1.5", "--drain-s", "1", "--prompt-len", "16", "48",
                           "--output-len", "4", "12", "--resume-tokens", "64", "--num-kv-blocks", "48",
                           "--max-num-seqs", "16", "--model-overrides", TINY, *_CPU),
              "fairness-*.json", 20, 60),
        Stage("families", ("decode-families", "--batch-sizes", "1,4", "--rank", "4", "--flora-rank", "4",
                           "--crossover-ranks", "4", "--prompt-len", "16", "--new-tokens", "4",
                           "--model", TINY, "--dtype", "float32", *_CPU),
              "decode-families-*.json", 20, 60),
        Stage("relay", ("relay", "--batches", "8", "--system-lens", "64", "--own-len", "8",
                        "--new-tokens", "4", "--rank", "4", "--model-overrides", TINY, "--dtype", "float32",
                        *_CPU),
              "relay-*.json", 15, 60),
        Stage("serving", (), "serve-summary.json", 30, 90),
    ),
    serving=ServingSizes(
        server=("--num-adapters", "100", "--num-tenants", "4", "--rank", "4", "--max-loras", "8",
                "--max-num-seqs", "16", "--max-num-batched-tokens", "1024", "--max-model-len", "512",
                "--model-overrides", TINY, *_CPU),
        workload=(("num_prompts", 24), ("num_tenants", 4), ("num_adapters", 100), ("prompt_len", 32),
                  ("prompt_dist", "longtail"), ("max_prompt_len", 128), ("output_len", 8),
                  ("zipf_alpha", 1.0), ("seed", 14))),
    selection=rf.Selection(decode_large_batch=4, families_batch=4, relay_batch=8, relay_system_len=64),
    device="cpu",
    has_goals=False,
)


@dataclass(frozen=True)
class Outcome:
    status: str
    """"ok", "skipped: why", or what went wrong."""
    seconds: float = 0.0
    limit_s: float | None = None
    result: dict[str, Any] | None = None

    @property
    def is_failure(self) -> bool:
        return self.status != "ok" and not self.status.startswith("skipped")


def run_stage(stage: Stage, folder: Path, limit_s: float) -> Outcome:
    """One benchmark in its own process group, killed at `limit_s`; its log in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "loraplex.benchmarks", *stage.argv, "--out", str(folder)]
    started = time.monotonic()
    with (folder / f"{stage.name}.log").open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=os.environ | {"PYTHONUNBUFFERED": "1"})
        try:
            code = process.wait(timeout=limit_s)
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            status = f"timed out after {limit_s:.0f} s"
    found = sorted(folder.glob(stage.result_glob))
    result = json.loads(found[0].read_text()) if found else None  # a run cut short may leave part of one
    if status == "ok" and result is None:
        status = "no result written"
    return Outcome(status, time.monotonic() - started, limit_s, result)


@dataclass(frozen=True)
class PassConfig:
    plan: PassPlan
    stages: frozenset[str]
    """The stages to run (the others are skipped, and say so)."""
    budget_s: float
    """The whole pass; each stage's limit is its own or what is left, whichever is less."""
    work: Path
    """Each stage's own results and logs, a folder each."""
    results: Path
    """Where the records are read (bench/results/)."""
    out: Path
    """Where regression-<device>.json goes."""
    device: str
    """torch.cuda.get_device_name (or "cpu"): picks the records."""
    commit: str


def run_pass(config: PassConfig) -> int:
    """The stages, the table, the JSON; 1 if the pass failed, else 0."""
    started = time.monotonic()
    print(f"regression pass on {config.device} at {config.commit}, budget {config.budget_s:.0f} s",
          flush=True)
    outcomes = _run_stages(config)
    comparisons = _compare(config, outcomes)
    elapsed = time.monotonic() - started
    print(f"\n{rf.table(comparisons)}\n")
    moved = [c.figure.name for c in comparisons if c.verdict in rf.FAILING]
    failed = [name for name, outcome in outcomes.items() if outcome.is_failure]
    has_failed = bool(moved or failed)
    path = _write(_report(config, elapsed, outcomes, comparisons, has_failed), config, has_failed)
    print(f"pass {'FAILED' if has_failed else 'ok'} in {elapsed:.0f} s"
          + (f"; moved or missed: {', '.join(moved)}" if moved else "")
          + (f"; stages failed: {', '.join(failed)}" if failed else "") + f"\nwrote {path}", flush=True)
    return 1 if has_failed else 0


def _run_stages(config: PassConfig) -> dict[str, Outcome]:
    started = time.monotonic()
    outcomes = {}
    for stage in config.plan.stages:
        left = config.budget_s - (time.monotonic() - started)
        limit = min(stage.max_s, left)
        if stage.name not in config.stages:
            outcome = Outcome("skipped: not asked for")
        elif stage.name == "serving" and (missing := regression_serving.missing_packages()):
            outcome = Outcome(f"skipped: the server's packages are not installed ({', '.join(missing)}; "
                              "scripts/gpu-regress.sh installs them from ./wheels)")
        elif left < stage.expected_s:
            outcome = Outcome(f"skipped: no longer fits (needs about {stage.expected_s:.0f} s, "
                              f"{max(left, 0):.0f} s left)")
        else:
            print(f"=== {stage.name} (limit {limit:.0f} s, {time.monotonic() - started:.0f} s in)",
                  flush=True)
            outcome = _run(config, stage, limit)
        outcomes[stage.name] = outcome
        took = f" in {outcome.seconds:.0f} s" if outcome.seconds else ""
        print(f"    {stage.name}: {outcome.status}{took}", flush=True)
        if outcome.is_failure:
            _print_tail(config.work / stage.name)
    return outcomes


def _run(config: PassConfig, stage: Stage, limit_s: float) -> Outcome:
    if stage.name != "serving":
        return run_stage(stage, config.work / stage.name, limit_s)
    started = time.monotonic()
    status, summary = regression_serving.run(config.plan.serving, config.work / "serving", limit_s)
    return Outcome(status, time.monotonic() - started, limit_s, summary)


def _compare(config: PassConfig, outcomes: dict[str, Outcome]) -> list[rf.Comparison]:
    all_figures = rf.figures(config.plan.selection)
    recorded = rf.records(all_figures, config.results, config.device, config.plan.argv())
    comparisons = []
    for figure in all_figures:
        outcome = outcomes.get(figure.stage, Outcome("skipped: not in the plan"))
        now = figure.read(outcome.result) if outcome.result else None
        record = recorded.get(figure.name)
        verdict = rf.compare(figure, now, record, config.plan.has_goals)
        if now is None and outcome.status != "ok":
            verdict = f"not measured ({outcome.status.split(':')[0]})"
        comparisons.append(rf.Comparison(figure, now, record, verdict))
    return comparisons


def _report(config: PassConfig, elapsed: float, outcomes: dict[str, Outcome],
            comparisons: list[rf.Comparison], has_failed: bool) -> dict[str, Any]:
    argv = config.plan.argv()
    return {
        "benchmark": "regression", "device": config.device, "commit": config.commit,
        "source_sha256": source_digest(), "passed": not has_failed, "budget_s": config.budget_s,
        "elapsed_s": round(elapsed, 1),
        "stages": {name: {"status": o.status, "seconds": round(o.seconds, 1),
                          "limit_s": None if o.limit_s is None else round(o.limit_s), "argv": argv[name]}
                   for name, o in outcomes.items()},
        "figures": {c.figure.name: {
            "stage": c.figure.stage, "now": c.now, "recorded": c.record.value if c.record else None,
            "record": c.record.source if c.record else None, "direction": c.figure.direction,
            "tolerance": c.figure.tolerance, "goal": str(c.figure.goal) if c.figure.goal else None,
            "verdict": c.verdict} for c in comparisons},
    }


def _write(report: dict[str, Any], config: PassConfig, has_failed: bool) -> Path:
    """<out>/regression-<device>.json; a failed pass never replaces the record it was compared
    with (written as regression-<device>-failed.json when <out> is where records are read)."""
    config.out.mkdir(parents=True, exist_ok=True)
    path = rf.regression_path(config.out, config.device)
    if has_failed and config.out.resolve() == config.results.resolve():
        path = path.with_name(path.stem + "-failed.json")
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def _print_tail(folder: Path, lines: int = 20) -> None:
    for log in sorted(folder.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"    --- last lines of {log.name}\n" + "\n".join(f"    {line}" for line in tail), flush=True)


def device_name(device: str) -> str:
    """torch.cuda.get_device_name, asked in a process of its own (so that this one holds no CUDA
    context beside the benchmarks'), or "cpu"."""
    if device == "cpu":
        return "cpu"
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode:
        raise SystemExit(f"no CUDA device: {probe.stderr.strip().splitlines()[-1:]}")
    return probe.stdout.strip()


def source_digest() -> str:
    """sha256 over the package's and the kernels' Python files (paths and contents): names the
    code that ran where git cannot."""
    digest = hashlib.sha256()
    for top in ("loraplex", "kernels"):
        for folder, dirs, files in sorted(os.walk(ROOT / top)):
            dirs.sort()
            for name in sorted(f for f in files if f.endswith(".py")):
                path = Path(folder) / name
                digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loraplex bench regression", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [stage.name for stage in REDUCED.stages]
    parser.add_argument("--stages", default=",".join(names), help=f"comma-separated, of {', '.join(names)}")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="the whole pass, install excluded (default 540: a 600 s device call)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the records are read")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where regression-<device>.json goes")
    parser.add_argument("--work", type=Path, help="the stages' own results and logs (default: a temporary "
                        "folder)")
    parser.add_argument("--commit", default=os.environ.get("LORAPLEX_COMMIT") or None,
                        help="the commit that runs (default $LORAPLEX_COMMIT, else git describe)")
    parser.add_argument("--smoke", action="store_true", help="on the CPU with a tiny model")
    args = parser.parse_args(argv)
    only = {name.strip() for name in args.stages.split(",") if name.strip()}
    if unknown := only - set(names):
        parser.error(f"unknown stages: {', '.join(sorted(unknown))}")
    plan = SMOKE if args.smoke else REDUCED
    return run_pass(PassConfig(
        plan=plan, stages=frozenset(only), budget_s=args.budget_s,
        work=args.work or Path(tempfile.mkdtemp(prefix="loraplex-regression-")), results=args.results,
        out=args.out, device=device_name(plan.device), commit=args.commit or code_commit()))


if __name__ == "__main__":
    sys.exit(main())

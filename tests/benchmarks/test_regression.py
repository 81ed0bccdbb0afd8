"""`loraplex bench regression`: the figures read from the recorded H100 results, the verdicts
either way of each tolerance and goal, which record a figure is compared with (reduced pass,
full-size result, none; by device), the budget and failing stages, and the whole pass on the
CPU with a tiny model."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from loraplex.benchmarks import regression, regression_serving
from loraplex.benchmarks import regression_figures as rf
from loraplex.benchmarks.cli import add_benchmarks, parse_args

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
H100 = "NVIDIA H100 80GB HBM3"
SEL = rf.Selection()


def _figure(name_start: str) -> rf.Figure:
    (figure,) = [f for f in rf.figures(SEL) if f.name.startswith(name_start)]
    return figure


def _json(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def test_figures_read_the_recorded_h100_results() -> None:
    decode = _json("decode-nvidia-h100-80gb-hbm3.json")
    (batch_64,) = [r for r in decode["rows"] if r["batch"] == 64 and r["adapters"] == 64]
    fairness = _json("fairness-nvidia-h100-80gb-hbm3.json")
    families = _json("decode-families-nvidia-h100-80gb-hbm3.json")["summary"]["batch_16"]
    serving = _json("serve-h100/serve-summary.json")["http_vs_offline"]
    assert _figure("decode tok/s, batch 64").read(decode) == batch_64["tok_s"]
    assert _figure("decode fraction of floor, batch 64").read(decode) == batch_64["fraction_of_floor"]
    assert _figure("decode tok/s, batch 1").read(decode) == decode["rows"][0]["tok_s"]
    assert _figure("fairness light p99 TTFT").read(fairness) \
        == fairness["summary"]["light p99 TTFT vs alone (vtc)"]
    assert _figure("fairness resume").read(fairness) == fairness["swap"]["swap_in / recompute"]
    assert _figure("families FLoRA / none").read(_json("decode-families-nvidia-h100-80gb-hbm3.json")) \
        == families["flora_r4_over_none"]
    assert _figure("serving HTTP / offline").read(_json("serve-h100/serve-summary.json")) == serving["ratio"]
    crossover = _json("decode-families-nvidia-h100-80gb-hbm3.json")["summary"]["crossover_flora_over_lora"]
    assert _figure("families FLoRA r4 / LoRA r4").read(_json("decode-families-nvidia-h100-80gb-hbm3.json")) \
        == crossover["rank_4_batch_16"]


def test_every_size_robust_figure_but_relay_has_an_h100_record() -> None:
    all_figures = rf.figures(SEL)
    records = rf.records(all_figures, RESULTS, H100, {})
    expected = {f.name for f in all_figures if f.stage != "relay" and f.is_size_robust}
    assert set(records) == expected  # relay's engine benchmark has no GPU result yet
    assert all(not r.is_reduced and r.source.startswith("full-size") for r in records.values())
    assert records[_figure("serving HTTP").name].source == "full-size, serve-h100/serve-summary.json"


def test_records_are_matched_by_device(tmp_path: Path) -> None:
    shutil.copy(RESULTS / "decode-nvidia-h100-80gb-hbm3.json", tmp_path)
    other = _json("decode-nvidia-h100-80gb-hbm3.json")
    other["rows"][0]["tok_s"] = 250.0
    (tmp_path / "decode-nvidia-h200.json").write_text(json.dumps(other))
    figure = _figure("decode tok/s, batch 1")
    assert rf.records((figure,), tmp_path, H100, {})[figure.name].value == 171.6
    assert rf.records((figure,), tmp_path, "NVIDIA H200", {})[figure.name].value == 250.0
    assert rf.records((figure,), tmp_path, "NVIDIA A100-SXM4-80GB", {}) == {}
    assert rf.regression_path(tmp_path, H100).name == "regression-nvidia-h100-80gb-hbm3.json"


def test_a_higher_is_better_figure_moves_below_its_tolerance_and_improves_above() -> None:
    figure = _figure("decode tok/s, batch 1")  # 5%
    record = rf.Record(100.0, "test", True)
    assert rf.compare(figure, 94.0, record) == rf.MOVED
    assert rf.compare(figure, 96.0, record) == rf.OK
    assert rf.compare(figure, 104.0, record) == rf.OK
    assert rf.compare(figure, 106.0, record) == rf.BETTER


def test_a_lower_is_better_figure_moves_above_its_tolerance() -> None:
    figure = _figure("families LoRA / none")  # 5%
    record = rf.Record(1.20, "test", False)
    assert rf.compare(figure, 1.27, record) == rf.MOVED
    assert rf.compare(figure, 1.25, record) == rf.OK
    assert rf.compare(figure, 1.13, record) == rf.BETTER


def test_a_goal_holds_whatever_was_recorded() -> None:
    ttft = _figure("fairness light p99 TTFT")  # <= 1.5
    assert rf.compare(ttft, 1.6, rf.Record(1.6, "test", True)) == rf.GOAL_MISSED
    assert rf.compare(ttft, 1.6, None) == rf.GOAL_MISSED
    assert rf.compare(ttft, 1.4, None) == rf.NO_RECORD
    assert rf.compare(ttft, 1.4, rf.Record(1.0, "test", True)) == rf.MOVED  # within the goal, 40% worse
    assert rf.compare(ttft, 1.6, rf.Record(1.6, "test", True), has_goals=False) == rf.OK
    throughput = _figure("fairness throughput")  # >= 0.95
    assert rf.compare(throughput, 0.94, rf.Record(0.94, "test", True)) == rf.GOAL_MISSED
    assert rf.compare(throughput, 0.96, rf.Record(0.94, "test", True)) == rf.OK
    assert rf.compare(throughput, None, None) == "not measured"


def _reduced(tmp_path: Path, figure: rf.Figure, value: float, argv: list[str]) -> None:
    (tmp_path / "regression-nvidia-h100-80gb-hbm3.json").write_text(json.dumps({
        "commit": "abc123", "stages": {figure.stage: {"argv": argv}},
        "figures": {figure.name: {"now": value}}}))


def test_a_reduced_pass_is_the_record_only_where_it_ran_the_same_stage(tmp_path: Path) -> None:
    shutil.copy(RESULTS / "decode-nvidia-h100-80gb-hbm3.json", tmp_path)
    figure, other = _figure("decode tok/s, batch 1"), _figure("decode first batch")
    _reduced(tmp_path, figure, 160.0, ["decode", "--batch-sizes", "1,64"])
    same = rf.records((figure, other), tmp_path, H100, {"decode": ["decode", "--batch-sizes", "1,64"]})
    assert same[figure.name] == rf.Record(
        160.0, "reduced, regression-nvidia-h100-80gb-hbm3.json (abc123)", True)
    assert not same[other.name].is_reduced  # not in the reduced pass: the full-size result's
    changed = rf.records((figure,), tmp_path, H100, {"decode": ["decode", "--batch-sizes", "1,32"]})
    assert changed[figure.name] == rf.Record(171.6, "full-size, decode-nvidia-h100-80gb-hbm3.json", False)


def test_a_size_dependent_figure_has_only_a_reduced_record(tmp_path: Path) -> None:
    folder = tmp_path / "serve-h100"
    folder.mkdir()
    for name in ("serve-summary.json", "serve-offline-nvidia-h100-80gb-hbm3.json"):
        shutil.copy(RESULTS / "serve-h100" / name, folder)
    offline, ratio = _figure("serving offline tok/s"), _figure("serving HTTP / offline")
    records = rf.records((offline, ratio), tmp_path, H100, {})
    assert set(records) == {ratio.name}
    _reduced(tmp_path, offline, 3000.0, [])
    assert rf.records((offline,), tmp_path, H100, {"serving": []})[offline.name].value == 3000.0


def test_a_result_cut_short_yields_no_figure() -> None:
    partial = {"benchmark": "decode-families", "rows": [], "crossover": [], "partial": True}
    assert _figure("families DoRA").read(partial) is None
    assert _figure("decode tok/s, batch 1").read({"rows": []}) is None


def test_the_table_names_each_record() -> None:
    figure = _figure("decode tok/s, batch 1")
    record = rf.Record(171.6, "full-size, decode-x.json", False)
    text = rf.table([rf.Comparison(figure, 150.0, record, rf.MOVED),
                     rf.Comparison(_figure("relay speedup vs prefix"), None, None, "not measured")])
    lines = text.splitlines()
    assert lines[0].split() == ["figure", "recorded", "now", "tolerance", "verdict"]
    assert "171.6 [1]" in lines[2] and "150.0" in lines[2] and lines[2].endswith("MOVED")
    assert lines[-1] == "[1] full-size, decode-x.json"


def _config(tmp_path: Path, plan: regression.PassPlan, budget_s: float = 100.0,
            results: Path | None = None) -> regression.PassConfig:
    return regression.PassConfig(
        plan=plan, stages=frozenset(s.name for s in plan.stages), budget_s=budget_s, work=tmp_path / "work",
        results=results or tmp_path / "results", out=tmp_path / "results", device="cpu", commit="test")


def test_stages_that_no_longer_fit_are_skipped_and_do_not_fail_the_pass(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(regression_serving, "missing_packages", lambda: ["uvicorn"])
    assert regression.run_pass(_config(tmp_path, regression.REDUCED, budget_s=50)) == 0
    report = json.loads((tmp_path / "results" / "regression-cpu.json").read_text())
    statuses = {name: stage["status"] for name, stage in report["stages"].items()}
    assert statuses["decode"] == "skipped: no longer fits (needs about 75 s, 50 s left)"
    assert statuses["serving"].startswith("skipped: the server's packages are not installed (uvicorn")
    assert {f["verdict"] for f in report["figures"].values()} == {"not measured (skipped)"}
    assert report["passed"] and report["commit"] == "test" and len(report["source_sha256"]) == 64


def test_a_failing_stage_fails_the_pass_and_keeps_the_record(tmp_path: Path) -> None:
    broken = regression.Stage("relay", ("relay", "--no-such-option"), "relay-*.json", 0, 60)
    plan = regression.PassPlan((broken,), regression.SMOKE.serving, regression.SMOKE.selection, "cpu")
    assert regression.run_pass(_config(tmp_path, plan)) == 1
    assert not (tmp_path / "results" / "regression-cpu.json").exists()  # where records are read
    report = json.loads((tmp_path / "results" / "regression-cpu-failed.json").read_text())
    assert report["stages"]["relay"]["status"] == "failed (exit 2)" and not report["passed"]


def test_a_stage_past_its_limit_is_killed(tmp_path: Path) -> None:
    (slow,) = [s for s in regression.SMOKE.stages if s.name == "fairness"]
    slow = regression.Stage(slow.name, (*slow.argv, "--duration-s", "600"), slow.result_glob, 0, 8)
    outcome = regression.run_stage(slow, tmp_path, 8)
    assert outcome.status == "timed out after 8 s" and outcome.is_failure
    assert 8 <= outcome.seconds < 20


def test_bench_regression_exits_with_the_pass_status() -> None:
    parser = argparse.ArgumentParser()
    add_benchmarks(parser)
    args = parse_args(parser, ["regression", "--stages", "decode,nonsense"])
    assert args.module == "regression"
    with pytest.raises(SystemExit) as exit_:
        args.run(args)
    assert exit_.value.code == 2


@pytest.mark.slow
def test_the_whole_pass_on_the_cpu(tmp_path: Path) -> None:
    """Every stage on a tiny model (about 30 s on two busy cores): each figure measured, and the
    JSON a later pass on the same device takes as its record."""
    status = regression.main(["--smoke", "--results", str(tmp_path / "none"), "--out", str(tmp_path / "out"),
                              "--work", str(tmp_path / "work"), "--commit", "smoke"])
    report = json.loads((tmp_path / "out" / "regression-cpu.json").read_text())
    assert {name: stage["status"] for name, stage in report["stages"].items()} == dict.fromkeys(
        ("decode", "fairness", "families", "relay", "serving"), "ok")
    assert status == 0 and report["passed"]  # no records and no goals on the CPU: nothing can fail
    assert all(f["now"] is not None and f["verdict"] == rf.NO_RECORD for f in report["figures"].values())
    all_figures = rf.figures(regression.SMOKE.selection)
    again = rf.records(all_figures, tmp_path / "out", "cpu", regression.SMOKE.argv())
    assert {name: r.value for name, r in again.items()} == {n: f["now"] for n, f in report["figures"].items()}
    assert all(r.source == "reduced, regression-cpu.json (smoke)" for r in again.values())


def test_the_serving_cpu_figure_counts_the_engine_process_and_reads_older_records() -> None:
    """With the engine in a process of its own the server's process is not all the CPU: the
    figure is the three thread figures' sum (the core's, the event loop's, the rest's), which an
    engine thread's run also adds up to; a record from before them gives its server figure."""
    from loraplex.benchmarks import serve_report

    figure = _figure("serving server CPU ms / token")
    engine = {"server_cpu_ms_per_token": 0.077, "engine_thread_cpu_ms_per_token": 0.157,
              "event_loop_cpu_ms_per_token": 0.053, "other_threads_cpu_ms_per_token": 0.024}
    assert serve_report.total_cpu_ms_per_token(engine) == 0.234
    summary = {"http_vs_offline": {"server_cpu_ms_per_token": 0.077, "total_cpu_ms_per_token": 0.234}}
    assert figure.read(summary) == 0.234
    assert figure.read({"http_vs_offline": {"server_cpu_ms_per_token": 0.443}}) == 0.443
    assert serve_report.total_cpu_ms_per_token({"server_cpu_ms_per_token": 0.3}) == 0.3

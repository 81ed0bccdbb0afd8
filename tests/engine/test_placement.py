"""Placement of prefill and decode (loraplex/engine/placement.py): the step-time model's
interference, the simulation's queues, and DistServe's trade: a tight TPOT target with long
prompts goes to disaggregated GPUs, where short prompts stay colocated."""

from __future__ import annotations

import pytest

from loraplex.benchmarks import placement_bench
from loraplex.engine.placement import (
    Placement,
    StepModel,
    Targets,
    Workload,
    attains,
    candidates,
    choose,
    simulate,
)

MODEL = StepModel()


def test_a_prompt_chunk_stretches_the_decodes_step_and_kv_crosses_at_link_speed():
    decodes = [2048] * 32
    assert MODEL.step(4096, decodes) > 10 * MODEL.step(0, decodes)  # what a colocated decode waits for
    assert MODEL.step(0, decodes, num_adapters=10) > MODEL.step(0, decodes)  # each adapter read once
    assert MODEL.transfer(2048) == pytest.approx(2 * MODEL.transfer(1024))
    assert candidates(1) == [Placement(0, 1)]
    assert [p.name for p in candidates(2)] == ["colocated", "1:1"]


def test_past_what_the_gpus_sustain_the_queue_grows():
    workload = Workload("w", 1024, 64)
    slow_ttft, _ = simulate(Placement(1, 1), workload, MODEL, rate=2.0, duration_s=20)
    fast_ttft, _ = simulate(Placement(1, 1), workload, MODEL, rate=60.0, duration_s=20)
    assert fast_ttft.mean() > 10 * slow_ttft.mean()
    targets = Targets(ttft_s=1.0, tpot_s=0.05)
    assert attains(Placement(0, 2), workload, targets, MODEL, 2.0, duration_s=20)
    assert not attains(Placement(0, 2), workload, targets, MODEL, 200.0, duration_s=20)


def test_long_prompts_with_a_tight_tpot_disaggregate_and_short_ones_stay_colocated():
    tight = choose(Workload("long", 4096, 256), Targets(ttft_s=2.0, tpot_s=0.012), duration_s=20)
    assert tight.placement == Placement(1, 1), tight.reason
    assert tight.goodput["1:1"] > tight.goodput["colocated"]
    short = choose(Workload("short", 128, 256), Targets(ttft_s=1.0, tpot_s=0.05), duration_s=20)
    assert short.placement == Placement(0, 2), short.reason
    assert "colocated serves" in short.reason and "1:1" in short.reason


def test_the_benchmark_writes_each_workloads_choice(tmp_path, capsys):
    placement_bench.main(["--prompt-len", "256", "--output-len", "32", "--duration-s", "5",
                          "--out", str(tmp_path)])
    assert "req/s within TTFT 1 s and TPOT 50 ms" in capsys.readouterr().out
    assert (tmp_path / "placement-simulated-h100.json").exists()

"""The slot simulation (`loraplex bench slots`): its virtual clock, its accounting, its slot
demand against the M/G/inf formula, fixed slots against the device pool, on small workloads
(each run takes well under a second)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from loraplex.benchmarks.serve_workload import WorkloadConfig, make_workload
from loraplex.benchmarks.slot_bench import main
from loraplex.benchmarks.slot_sim import (
    SlotSimConfig,
    SlotSimulation,
    VirtualWorker,
    analytic_adapters_running,
    analytic_slot_shortage,
    simulate,
    zipf_probabilities,
)

SMALL = WorkloadConfig(num_prompts=200, request_rate=8.0, prompt_len=64, prompt_dist="longtail",
                       output_len=16, max_prompt_len=256, num_tenants=4, num_adapters=100, seed=3)


def test_the_worker_runs_one_job_at_a_time_on_the_virtual_clock():
    now = [0.0]
    device_free = [0.0]
    worker = VirtualWorker(lambda: now[0], 0.5, lambda: device_free[0])
    first, second = worker.submit(lambda: "a"), worker.submit(lambda x: x * 2, 21)
    worker.run_until(0.49)
    assert not first.done() and worker.next_done == 0.5
    worker.run_until(0.5)
    assert first.result() == "a" and not second.done()  # the second starts when the first ends
    worker.run_until(1.0)
    assert second.result() == 42 and math.isinf(worker.next_done)
    now[0], device_free[0] = 2.0, 3.0
    third = worker.submit(lambda: None)  # not before the launched steps end
    worker.run_until(3.49)
    assert not third.done()
    worker.run_until(3.5)
    assert third.done()


def test_every_request_completes_and_the_run_is_deterministic():
    config = SlotSimConfig(workload=SMALL, num_slots=8)
    one, two = simulate(config), simulate(config)
    assert one == two
    assert one["completed"] == SMALL.num_prompts
    tokens = sum(r.max_tokens for r in make_workload(SMALL))
    assert one["output_throughput"] == pytest.approx(tokens / one["duration_s"], rel=1e-3)
    assert one["ttft_ms"]["p50"] <= one["ttft_ms"]["p99"] <= one["e2e_ms"]["p99"]
    used = len({r.adapter for r in make_workload(SMALL)})
    assert one["adapter_host_loads"] >= used and one["adapter_slot_loads"] >= used


def test_with_a_slot_for_every_adapter_no_request_waits_for_one():
    sim = simulate(SlotSimConfig(workload=SMALL, num_slots=SMALL.num_adapters))
    used = len({r.adapter for r in make_workload(SMALL)})
    assert sim["requests_waited_for_slot"] == 0 and sim["preemptions"] == 0
    assert sim["adapter_slot_loads"] == used  # each copied once, never evicted
    assert sim["adapters_running"]["max"] <= SMALL.num_adapters


def test_fewer_slots_than_adapters_in_flight_make_requests_wait():
    busy = replace(SMALL, request_rate=30.0)
    ample = simulate(SlotSimConfig(workload=busy, num_slots=busy.num_adapters))
    few = simulate(SlotSimConfig(workload=busy, num_slots=4))
    assert ample["adapters_running"]["max"] > 4  # demand exceeds 4 slots at times
    assert few["adapters_running"]["max"] <= 4
    assert few["requests_waited_for_slot"] > 0
    assert few["adapter_slot_loads"] > ample["adapter_slot_loads"]
    assert few["ttft_ms"]["p99"] > ample["ttft_ms"]["p99"]


def test_the_analytic_demand_matches_the_simulated_one_with_unlimited_slots():
    """M/G/inf: the mean number of adapters with a request running is the sum over adapters of
    1 - exp(-rate x p_k x D), D the mean running time (measured in the same run)."""
    workload = replace(SMALL, num_prompts=1500, request_rate=20.0, num_adapters=60, prompt_dist="fixed",
                       output_len=64)
    sim = simulate(SlotSimConfig(workload=workload, num_slots=workload.num_adapters))
    analytic = analytic_adapters_running(workload.request_rate, workload.num_adapters, workload.zipf_alpha,
                                         sim["mean_running_s"])
    assert sim["adapters_running"]["mean"] == pytest.approx(analytic, rel=0.1)
    # Not the requests running (rate x D): hot adapters' requests share their slot.
    assert workload.request_rate * sim["mean_running_s"] > 1.3 * analytic


def test_the_analytic_demand_at_its_limits():
    assert zipf_probabilities(1000, 1.0).sum() == pytest.approx(1.0)
    assert analytic_adapters_running(10.0, 1, 1.0, 100.0) == pytest.approx(1.0)  # one adapter, always busy
    assert analytic_adapters_running(1e-6, 1000, 1.0, 1.0) == pytest.approx(1e-6, rel=1e-3)  # rate x D
    low, high = (analytic_adapters_running(17.54, 1000, 1.0, d) for d in (2.0, 2.9))
    assert 25 < low < high < 40


def test_the_pool_holds_more_adapters_than_the_fixed_slots_of_the_same_memory():
    """The pool of 8 slots' memory beside the KV cache: while the KV cache leaves pages free,
    more than 8 adapters are resident and fewer requests wait for one."""
    busy = replace(SMALL, request_rate=30.0)
    fixed = simulate(SlotSimConfig(workload=busy, num_slots=4, num_kv_blocks=2048))
    pool = simulate(SlotSimConfig(workload=busy, num_slots=4, num_kv_blocks=2048, pool=True))
    assert pool["adapters_running"]["max"] > 4 >= fixed["adapters_running"]["max"]
    assert pool["adapter_slot_loads"] < fixed["adapter_slot_loads"]
    assert pool["ttft_ms"]["p99"] < fixed["ttft_ms"]["p99"]
    capped = simulate(SlotSimConfig(workload=busy, num_slots=4, num_kv_blocks=2048, pool=True, max_loras=4))
    assert capped["adapters_running"]["max"] <= 4


def test_places_held_for_loading_adapters_spare_a_batch_its_fairness_swaps():
    """600 requests over 40 tenants sent at once: without holding places, the tenants whose
    adapters are resident first take the places, and lose them one fairness preemption at a
    time as the others' adapters arrive."""
    batch = replace(SMALL, num_prompts=600, request_rate=math.inf, num_tenants=40, num_adapters=1000,
                    prompt_len=256, output_len=128, max_prompt_len=1024)
    swaps = {}
    for hold in (False, True):
        sim = SlotSimulation(SlotSimConfig(workload=batch, pool=True, hold_places_for_loading=hold))
        assert sim.run()["completed"] == 600
        swaps[hold] = sim.scheduler.preemptions["fairness", "swap"]
    assert swaps[False] > 50 and swaps[True] <= 5, swaps


def test_the_command_writes_json_and_a_log(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("loraplex.benchmarks.slot_bench.ISSUE_14_WORKLOAD",
                        replace(SMALL, num_adapters=1000, num_prompts=60))
    main(["--rates", "4,40", "--sweep-prompts", "60", "--long-prompts", "60", "--num-slots", "8",
          "--slot-counts", "8,100", "--measured", str(tmp_path / "none"), "--out", str(tmp_path),
          "--tag", "t"])
    written = tmp_path / "slots-t-simulated-h100.json"
    assert written.exists() and written.with_suffix(".log").exists()
    assert "highest rate with p99 TTFT < 1 s" in capsys.readouterr().out


def test_the_analytic_slot_shortage():
    full, waiting = analytic_slot_shortage(17.54, 1000, 1.0, 2.6, 32)
    assert 0 < waiting < full < 1
    assert analytic_slot_shortage(17.54, 1000, 1.0, 2.6, 1000)[0] < 1e-12  # a slot each: never all busy
    assert analytic_slot_shortage(1000.0, 10, 0.0, 100.0, 10)[0] == pytest.approx(1.0)  # all always busy
    # Poisson-binomial against a direct count over two adapters: P(both busy)
    rate, running_s = 3.0, 0.5
    busy = [1 - math.exp(-rate * p * running_s) for p in (2 / 3, 1 / 3)]
    assert analytic_slot_shortage(rate, 2, 1.0, running_s, 2)[0] == pytest.approx(busy[0] * busy[1])
    shortages = [analytic_slot_shortage(r, 1000, 1.0, 2.6, 32)[1] for r in (10, 14, 17.54)]
    assert shortages == sorted(shortages)

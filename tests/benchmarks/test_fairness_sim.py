"""The fairness benchmark's workload on the virtual clock (`loraplex bench fairness-sim`): light
tenants' p99 TTFT and time between tokens beside a flooding tenant against running alone, on the
H100 step-time model.
It failed at 429120f (7.3x: a preempted request's own prompt blocks were left on the device as
evictable cache, evicted by the pressure that preempted it, and computed again on resume)."""

from __future__ import annotations

import statistics

import pytest

from loraplex.benchmarks.fairness_sim import FairnessSimConfig, simulate, simulate_run
from loraplex.benchmarks.fairness_workload import HEAVY, FairnessWorkload, make_arrivals, system_prompts

RECOMMENDED = {"max_num_batched_tokens": 1536, "fairness_kv_headroom": 0.15625}
"""The settings that meet issue 29's goals here, with and without system prompts (`loraplex bench
fairness --max-num-batched-tokens 1536 --fairness-kv-headroom 0.15625`): steps of at most 1,536
prompt tokens keep the light tenants' time between tokens at what it is alone (their own prompts,
less a 256-token system prompt, reach 1,792 tokens), and the headroom lets their prompts start
without swapping the flooding tenant's requests out first."""


@pytest.fixture(scope="module")
def seed_0():
    return simulate(FairnessSimConfig())


@pytest.fixture(scope="module", params=[0, 256], ids=["no-system-prompt", "system-prompt-256"])
def recommended(request):
    return [simulate(FairnessSimConfig(workload=FairnessWorkload(seed=seed, system_prompt_len=request.param),
                                       **RECOMMENDED))
            for seed in range(5)]


def test_issue_29_goals_hold_on_the_median_of_five_seeds(recommended):
    """Light p99 TTFT <= 1.5x alone, light p99 TBT <= 1.1x alone, throughput >= 0.95x FCFS, on
    the median of seeds 0-4 (one run's p99 over ~270 light requests is its third-slowest start,
    and a burst decides it). Medians with the benchmark's earlier settings (8,192 tokens a step,
    no headroom): 1.58x, 1.47x, 0.999x and 362 fairness preemptions a minute (with system
    prompts 1.94x, 1.70x, 1.001x, 441); with 1,536 tokens and no headroom 1.70x, 1.05x, 1.004x,
    296 (2.05x, 1.03x, 1.004x, 407); with both 1.31x, 1.01x, 0.983x, 13 (1.45x, 1.02x, 0.971x, 4)."""
    summaries = [result["summary"] for result in recommended]

    def median(key: str) -> float:
        return statistics.median(summary[key] for summary in summaries)

    assert median("light p99 TTFT vs alone (vtc)") <= 1.5, summaries
    assert median("light p99 TBT vs alone (vtc)") <= 1.1, summaries
    assert median("throughput vtc / fcfs") >= 0.95, summaries
    fairness = [r["runs"]["vtc"]["preemptions_per_minute"].get("fairness:swap", 0.0) for r in recommended]
    assert statistics.median(fairness) < 60, fairness  # light prompts start in the headroom


def test_the_benchmarks_earlier_step_budget_misses_the_time_between_tokens(seed_0):
    """8,192 tokens a step: a light tenant's tokens wait for steps that carry up to 8,192 of the
    flooding tenant's prompt tokens (1.48x alone on seed 0)."""
    assert seed_0["summary"]["light p99 TBT vs alone (vtc)"] > 1.1, seed_0["summary"]


def test_light_tenants_keep_their_latency_beside_a_flooding_tenant(seed_0):
    summary = seed_0["summary"]
    assert summary["light p99 TTFT vs alone (vtc)"] <= 1.5, summary
    assert summary["light p99 TTFT vs alone (fcfs)"] > 10, summary  # the flood is real
    assert summary["throughput vtc / fcfs"] >= 0.95, summary
    light = seed_0["runs"]["vtc"]["light"]  # the tail's requests, for telling start-up from steady state
    slowest = light["slowest_starts"]
    assert len(slowest) == 5 and slowest[0]["ttft_s"] == max(s["ttft_s"] for s in slowest)
    assert slowest[0]["ttft_s"] >= light["ttft_p99_s"]


def test_the_prompt_chunk_cap_shortens_the_light_tenants_time_between_tokens(seed_0):
    """Off by default (on the H100 it cost throughput that this model does not show), the cap
    still does what it says: the flooding tenant's prompt chunks no longer stretch the steps
    that light tenants' tokens wait for (1.51x alone without it, 1.21x with 1,024)."""
    capped = simulate(FairnessSimConfig(max_capped_prefill_tokens=1024))["summary"]
    uncapped = seed_0["summary"]
    assert capped["light p99 TBT vs alone (vtc)"] <= 1.3, capped
    assert capped["light p99 TBT vs alone (vtc)"] < uncapped["light p99 TBT vs alone (vtc)"] - 0.1


def test_preempted_requests_resume_from_their_host_copy_not_from_scratch(seed_0):
    vtc = seed_0["runs"]["vtc"]["preemptions_per_minute"]
    assert vtc.get("fairness:swap", 0) > 0  # VTC makes room for light tenants by swapping
    assert "fairness:recompute" not in vtc and "kv:recompute" not in vtc


def test_the_light_tenants_arrivals_are_the_same_alone_and_beside_the_heavy_one():
    workload = FairnessWorkload(duration_s=5.0)
    def rows(requests):
        return [(r.arrival_s, r.tenant, r.prompt_token_ids, r.max_tokens) for r in requests]

    everyone = make_arrivals(workload)
    alone, light = rows(make_arrivals(workload, heavy=False)), rows(r for r in everyone if r.tenant != HEAVY)
    assert alone == light and len(everyone) > len(light)


def test_system_prompts_start_every_prompt_of_their_tenant_and_differ_between_tenants():
    workload = FairnessWorkload(duration_s=3.0, system_prompt_len=64)
    prompts = system_prompts(workload)
    assert len({tuple(p) for p in prompts.values()}) == len(prompts)
    for request in make_arrivals(workload):
        assert request.prompt_token_ids[:64] == prompts[request.tenant]
        assert 512 <= len(request.prompt_token_ids) <= 2048
    with pytest.raises(ValueError, match="system_prompt_len"):
        FairnessWorkload(system_prompt_len=512)


def test_pinned_system_prompts_are_shared_and_stay_on_the_device():
    config = FairnessSimConfig(workload=FairnessWorkload(duration_s=8.0, system_prompt_len=256))
    row = simulate_run(config, "vtc")
    assert row["light"]["started"] == row["light"]["requests"]
    assert not any(key.endswith("recompute") for key in row["preemptions_per_minute"])

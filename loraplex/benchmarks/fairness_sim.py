"""`loraplex bench fairness`'s workload on a virtual clock: the real Scheduler, VtcPolicy,
FcfsPolicy, BlockManager (prefix cache on, as in the engine) and host swap pool, driven by the
slot simulation's engine loop (async scheduling; loraplex/benchmarks/slot_sim.py) with the
H100's offline step-time model, fed the benchmark's own requests
(loraplex/benchmarks/fairness_workload.py, same seed) on its engine's sizes (4,096 KV blocks of
16 tokens, a 16 GiB swap pool of 2 MiB blocks, at most 256 running, 8,192 tokens a step); a
tenant's system prompt, when the workload has one, is pinned as the engine pins a registered
one. It runs on a CPU in seconds and shows light tenants' TTFT and TBT against running alone,
so that a scheduler change that costs them is seen in CI, not on the next GPU pass.

Step time: the H100's decode line (6.8 ms + 0.062 ms a decode row, fitted to
bench/results/decode-nvidia-h100-80gb-hbm3.json), 0.030 ms a prompt token, no HTTP, and 0.040
ms a block swapped out (2 MiB at the 52 GB/s the fairness run measured); swap-ins run beside
the step. The four adapters stay resident (four slots, as the benchmark's engine has)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from loraplex.benchmarks.fairness_workload import (
    RUNS,
    TENANTS,
    FairnessWorkload,
    group_figures,
    make_arrivals,
    summarize,
    system_prompts,
)
from loraplex.benchmarks.results import RESULTS, write
from loraplex.benchmarks.serve_workload import BenchRequest
from loraplex.benchmarks.slot_sim import SlotSimConfig, SlotSimulation, StepModel
from loraplex.engine.prefix_cache import block_hashes
from loraplex.engine_config import SchedulerConfig

H100_OFFLINE_STEP = StepModel(base_ms=6.8, per_decode_ms=0.062, per_prefill_token_ms=0.030,
                              per_sampled_token_ms=0.0, per_swapped_out_block_ms=0.040)
GOALS = {"light p99 TTFT vs alone (vtc)": 1.5, "light p99 TBT vs alone (vtc)": 1.1}
"""Issue 29's goals (at most), as the GPU benchmark states them."""


@dataclass(frozen=True)
class FairnessSimConfig:
    workload: FairnessWorkload = field(default_factory=FairnessWorkload)
    drain_s: float = 15.0
    """The run ends this long after arrivals stop (unfinished requests count what they got)."""
    num_kv_blocks: int = 4096
    num_host_blocks: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    fairness_bound: float = 4096.0
    max_capped_prefill_tokens: int = 0
    """VTC's prompt-chunk cap (0: none, the engine's default)."""
    fairness_kv_headroom: float = 0.0
    """SchedulerConfig.fairness_kv_headroom (0: none, the engine's default)."""
    fairness_patience_tokens: int = SchedulerConfig.fairness_patience_tokens
    """SchedulerConfig.fairness_patience_tokens (the engine's default)."""
    preload_adapters: bool = True
    """Each run's adapters are resident before it starts, as in the GPU benchmark's VTC run (its
    earlier runs on the same engine loaded all four; the light tenants' adapters are cold in its
    first run, alone, where a pinned adapter's copy takes about 2 ms of an idle device). False:
    each run starts cold, its first requests waiting for host loads and for slot copies that
    queue behind the steps in flight (on seed 1 that wait was the light tenants' p99 TTFT)."""
    step: StepModel = field(default_factory=lambda: H100_OFFLINE_STEP)
    scheduler_delay_factor: float = 1.0
    """SchedulerConfig.scheduler_delay_factor (it acts only with the step model's eager floor)."""


def simulate_run(config: FairnessSimConfig, policy: str, heavy: bool = True) -> dict[str, Any]:
    """One of the benchmark's runs on a fresh engine: `policy` ("vtc" or "fcfs") serves the
    arrivals for `duration_s` + `drain_s` seconds; unfinished requests count what they got."""
    sim = SlotSimulation(SlotSimConfig(
        num_slots=len(TENANTS), max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, num_kv_blocks=config.num_kv_blocks,
        num_host_blocks=config.num_host_blocks, policy=policy, fairness_bound=config.fairness_bound,
        max_capped_prefill_tokens=config.max_capped_prefill_tokens,
        fairness_kv_headroom=config.fairness_kv_headroom, request_overhead_ms=0.0, step=config.step,
        fairness_patience_tokens=config.fairness_patience_tokens,
        scheduler_delay_factor=config.scheduler_delay_factor))
    requests = make_arrivals(config.workload, heavy)
    if config.preload_adapters:
        sim.preload([r.adapter for r in requests])
    if config.workload.system_prompt_len:
        _pin(sim, system_prompts(config.workload))
    sim.serve(requests, end_s=config.workload.duration_s + config.drain_s)
    elapsed = sim.now - sim.start_s
    arrived = {f"{sim.num_runs}-{r.index}": (r.arrival_s, r.tenant) for r in requests}
    token_s = {request_id: [t - sim.start_s for t in timing.token_s]  # on the arrivals' clock
               for request_id, timing in sim.timings.items()}
    row: dict[str, Any] = {"policy": policy, "elapsed_s": round(elapsed, 2),
                           **group_figures(arrived, token_s, elapsed)}
    minutes = elapsed / 60
    row["output_tokens_per_s"] = round(sum(map(len, token_s.values())) / elapsed, 1)
    row["preemptions_per_minute"] = {f"{cause}:{mode}": round(n / minutes, 1)
                                     for (cause, mode), n in sorted(sim.scheduler.preemptions.items())}
    row["num_steps"] = sim.num_steps
    return row


def _pin(sim: SlotSimulation, prompts: dict[str, list[int]]) -> None:
    """Each tenant's system prompt prefilled and its full blocks held, as the engine pins a
    registered system prompt (`LLMEngine.pin_prompt`)."""
    warm_up = [BenchRequest(i, 0.0, tenant, tenant, tokens, 1)
               for i, (tenant, tokens) in enumerate(prompts.items())]
    sim.serve(warm_up)
    for tenant, tokens in prompts.items():
        hashes = block_hashes(tokens, sim.blocks.block_size, tenant, tenant)
        sim.blocks.match(hashes, len(hashes))


def simulate(config: FairnessSimConfig) -> dict[str, Any]:
    """The benchmark's three runs and its summary ratios."""
    runs = {RUNS[name]: simulate_run(config, "fcfs" if name == "fcfs" else "vtc", heavy=name != "alone")
            for name in RUNS}
    summary = summarize(runs)
    return {"benchmark": "fairness-simulated", "config": asdict(config), "runs": runs, "summary": summary}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="loraplex bench fairness-sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system-prompt-len", type=int, default=0)
    parser.add_argument("--seed", type=int, nargs="+", default=[0])
    parser.add_argument("--max-capped-prefill-tokens", type=int, default=0,
                        help="VTC's prompt-chunk cap (default 0: none, as the engine)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="token budget of a step (default 8192, as the GPU benchmark's)")
    parser.add_argument("--fairness-kv-headroom", type=float, default=0.0,
                        help="SchedulerConfig.fairness_kv_headroom (default 0: none, as the engine)")
    parser.add_argument("--fairness-patience-tokens", type=int,
                        default=SchedulerConfig.fairness_patience_tokens,
                        help="SchedulerConfig.fairness_patience_tokens (default %(default)s, as the engine)")
    parser.add_argument("--eager-floor-ms", type=float, default=H100_OFFLINE_STEP.eager_floor_ms,
                        help="the least a step with prompt tokens takes (StepModel.eager_floor_ms)")
    parser.add_argument("--scheduler-delay-factor", type=float, default=1.0,
                        help="SchedulerConfig.scheduler_delay_factor (acts with an eager floor)")
    parser.add_argument("--tag", default="", help="results file suffix")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"results folder (default {RESULTS})")
    args = parser.parse_args(argv)
    results = []
    for seed in args.seed:
        workload = FairnessWorkload(seed=seed, system_prompt_len=args.system_prompt_len)
        config = FairnessSimConfig(workload=workload, max_num_batched_tokens=args.max_num_batched_tokens,
                                   max_capped_prefill_tokens=args.max_capped_prefill_tokens,
                                   fairness_kv_headroom=args.fairness_kv_headroom,
                                   fairness_patience_tokens=args.fairness_patience_tokens,
                                   step=replace(H100_OFFLINE_STEP, eager_floor_ms=args.eager_floor_ms),
                                   scheduler_delay_factor=args.scheduler_delay_factor)
        result = simulate(config)
        for name, run in result["runs"].items():
            print(f"seed {seed} {name:28s} {json.dumps({k: run[k] for k in run if k != 'policy'})}")
        print(f"seed {seed} summary {json.dumps(result['summary'])}", flush=True)
        results.append(result)
    name = "fairness" + (f"-{args.tag}" if args.tag else "")
    result = {"benchmark": "fairness-simulated", "device": "simulated-h100", "seeds": results}
    print(f"wrote {write(result, args.out, name)}")

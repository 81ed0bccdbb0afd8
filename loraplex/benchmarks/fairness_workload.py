"""The fairness benchmark's requests, made from a seed: four tenants, each with its own adapter
(named after it), Poisson arrivals per tenant, the heavy tenant at `heavy_factor` times a light
one's rate; prompt and output lengths uniform in their ranges. With `system_prompt_len`, each
tenant's prompts start with that tenant's own system prompt (the rest is the request's own).
The GPU benchmark (`loraplex bench fairness`) and its simulation (`fairness-sim`) serve the very
same list, and report it with the same figures (`group_figures`, `summarize`). Needs numpy only."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from loraplex.benchmarks.serve_workload import FIRST_TOKEN, BenchRequest

TENANTS = ("heavy", "light-1", "light-2", "light-3")
HEAVY = TENANTS[0]
RUNS = {"alone": "light tenants alone (vtc)", "fcfs": "fcfs", "vtc": "vtc"}
"""The benchmark's runs: short name -> the name its results carry."""


@dataclass(frozen=True)
class FairnessWorkload:
    light_rate: float = 3.0
    """Requests a second from each light tenant."""
    heavy_factor: float = 4.0
    prompt_len: tuple[int, int] = (512, 2048)
    """Prompt lengths (system prompt included), uniform in [low, high]."""
    output_len: tuple[int, int] = (64, 256)
    duration_s: float = 30.0
    """Arrivals stop after this long."""
    system_prompt_len: int = 0
    """Tokens of each tenant's system prompt (0: none); at most the shortest prompt less one."""
    vocab_size: int = 128256
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.system_prompt_len < self.prompt_len[0]:
            raise ValueError(f"system_prompt_len must be in [0, {self.prompt_len[0]}) (the shortest "
                             f"prompt), not {self.system_prompt_len}")


def system_prompts(workload: FairnessWorkload) -> dict[str, list[int]]:
    """Each tenant's system prompt (empty lists without one)."""
    rng = np.random.default_rng([workload.seed, 1])
    return {tenant: rng.integers(FIRST_TOKEN, workload.vocab_size, workload.system_prompt_len).tolist()
            for tenant in TENANTS}


def make_arrivals(workload: FairnessWorkload, heavy: bool = True) -> list[BenchRequest]:
    """The requests by arrival time (without the heavy tenant's when `heavy` is False: the light
    tenants' arrivals are the same either way)."""
    rng = random.Random(workload.seed)
    timed = []
    for tenant in TENANTS:
        rate = workload.light_rate * (workload.heavy_factor if tenant == HEAVY else 1.0)
        t = rng.expovariate(rate)
        while t < workload.duration_s:
            timed.append((t, tenant, rng.randint(*workload.prompt_len), rng.randint(*workload.output_len)))
            t += rng.expovariate(rate)
    timed.sort()
    system = system_prompts(workload)
    tokens = np.random.default_rng(workload.seed)
    requests = []
    for index, (at, tenant, prompt_len, output_len) in enumerate(timed):
        own = tokens.integers(FIRST_TOKEN, workload.vocab_size, prompt_len - workload.system_prompt_len)
        requests.append(BenchRequest(index, at, tenant, tenant, system[tenant] + own.tolist(), output_len))
    return requests if heavy else [r for r in requests if r.tenant != HEAVY]


def group_figures(arrived: dict[str, tuple[float, str]], token_s: dict[str, list[float]],
                  end_s: float) -> dict[str, dict[str, Any]]:
    """Light and heavy tenants' requests, how many started, and their TTFT and TBT p50 and p99,
    from each request's (arrival, tenant) and the times its tokens came (one that got none
    counts as waiting until `end_s`). Times in seconds on one clock."""
    figures = {}
    for group, members in (("light", TENANTS[1:]), ("heavy", (HEAVY,))):
        ids = [r for r, (_, tenant) in arrived.items() if tenant in members]
        if not ids:
            continue
        ttft = [(token_s[r][0] if token_s.get(r) else end_s) - arrived[r][0] for r in ids]
        tbt = [b - a for r in ids for a, b in zip(token_s.get(r, []), token_s.get(r, [])[1:])]
        figures[group] = {"requests": len(ids), "started": sum(bool(token_s.get(r)) for r in ids),
                          "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
                          "tbt_p50_s": _pct(tbt, 50), "tbt_p99_s": _pct(tbt, 99),
                          "slowest_starts": _slowest(ids, ttft, arrived)}
    return figures


def _slowest(ids: list[str], ttft: list[float], arrived: dict[str, tuple[float, str]],
             count: int = 5) -> list[dict[str, Any]]:
    """The `count` requests that waited longest for their first token: when each arrived and
    how long it waited, so that a tail can be told apart as a run's start (cold adapters, every
    tenant at once) or its steady state."""
    worst = sorted(zip(ttft, ids), reverse=True)[:count]
    return [{"request": r, "arrival_s": round(arrived[r][0], 3), "ttft_s": round(t, 4)} for t, r in worst]


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """The benchmark's headline ratios from whichever of its runs (named as in RUNS) are there."""
    light = {name: runs[RUNS[name]]["light"] for name in RUNS if RUNS[name] in runs}
    summary = {}
    if "alone" in light and "vtc" in light:
        summary["light p99 TTFT vs alone (vtc)"] = _ratio(light["vtc"]["ttft_p99_s"],
                                                          light["alone"]["ttft_p99_s"])
        summary["light p99 TBT vs alone (vtc)"] = _ratio(light["vtc"]["tbt_p99_s"],
                                                         light["alone"]["tbt_p99_s"])
    if "alone" in light and "fcfs" in light:
        summary["light p99 TTFT vs alone (fcfs)"] = _ratio(light["fcfs"]["ttft_p99_s"],
                                                           light["alone"]["ttft_p99_s"])
    if "vtc" in light and "fcfs" in light:
        summary["throughput vtc / fcfs"] = _ratio(runs["vtc"]["output_tokens_per_s"],
                                                  runs["fcfs"]["output_tokens_per_s"])
    return summary


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None

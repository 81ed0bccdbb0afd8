"""The fairness benchmark's requests, made from a seed: four tenants, each with its own adapter
(named after it), Poisson arrivals per tenant, the heavy tenant at `heavy_factor` times a light
one's rate; prompt and output lengths uniform in their ranges. With `system_prompt_len`, each
tenant's prompts start with that tenant's own system prompt (the rest is the request's own).
The GPU benchmark (`loraplex bench fairness`) and its simulation (`fairness-sim`) serve the very
same list. Needs numpy only."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from loraplex.benchmarks.serve_workload import FIRST_TOKEN, BenchRequest

TENANTS = ("heavy", "light-1", "light-2", "light-3")
HEAVY = TENANTS[0]


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

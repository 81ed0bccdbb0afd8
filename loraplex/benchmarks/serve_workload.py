"""The requests of a serving benchmark, made from a seed: when each arrives (Poisson or gamma
arrivals at a rate, or all at once), its prompt (token ids) and output length (fixed or
long-tailed), its tenant and its adapter (Zipf popularity over the registered adapters). The
HTTP benchmark (`loraplex bench serve`) and the offline engine pass of the synthetic server make
the same list from the same config, so both run the very same requests.

Names are fixed: tenants `t000`, `t001`, ...; adapter j is `a0000`-style and belongs to tenant
`j % num_tenants`. Needs numpy only (no torch, no HTTP)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

Distribution = Literal["fixed", "longtail"]
LONGTAIL_SIGMA = 1.0
"""Log-normal sigma of long-tailed lengths (their median is about 0.6 of their mean; p99 about 6x)."""


@dataclass(frozen=True)
class WorkloadConfig:
    num_prompts: int = 500
    request_rate: float = math.inf
    """Requests per second; inf sends them all at once (saturation)."""
    burstiness: float = 1.0
    """Gamma shape of the gaps between arrivals: 1 is Poisson; below 1 burstier, above smoother."""
    prompt_len: int = 256
    """Mean prompt length in tokens."""
    prompt_dist: Distribution = "fixed"
    output_len: int = 128
    """Mean output length in tokens (exact: requests ignore end-of-sequence)."""
    output_dist: Distribution = "fixed"
    max_prompt_len: int = 2048
    max_output_len: int = 1024
    num_tenants: int = 1
    num_adapters: int = 0
    """Adapters over which requests spread (0: every request asks for the base model)."""
    zipf_alpha: float = 1.0
    """Adapter k (from 1) is asked for with weight 1 / k^alpha; 0 is uniform."""
    vocab_size: int = 32000
    """Prompt tokens are drawn from [FIRST_TOKEN, vocab_size)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.num_tenants < 1 or self.num_adapters < 0:
            raise ValueError("num_prompts and num_tenants must be positive, num_adapters >= 0")
        if not self.request_rate > 0 or not self.burstiness > 0:
            raise ValueError("request_rate and burstiness must be positive")
        if self.prompt_len < 1 or self.output_len < 1 or self.vocab_size <= FIRST_TOKEN:
            raise ValueError("lengths must be positive and the vocabulary larger than "
                             f"{FIRST_TOKEN} tokens")


FIRST_TOKEN = 16
"""Prompt tokens start past the ids that tokenizers usually give special tokens."""


@dataclass(frozen=True)
class BenchRequest:
    index: int
    arrival_s: float
    """Seconds after the start at which it is sent."""
    tenant: str
    adapter: str | None
    """An adapter name of `tenant`, or None for the base model."""
    prompt_token_ids: list[int]
    max_tokens: int


def tenant_name(index: int) -> str:
    return f"t{index:03d}"


def adapter_name(index: int) -> str:
    return f"a{index:04d}"


def adapter_owner(index: int, num_tenants: int) -> str:
    return tenant_name(index % num_tenants)


def make_workload(config: WorkloadConfig) -> list[BenchRequest]:
    rng = np.random.default_rng(config.seed)
    n = config.num_prompts
    prompt_lens = _lengths(rng, config.prompt_dist, config.prompt_len, config.max_prompt_len, n)
    output_lens = _lengths(rng, config.output_dist, config.output_len, config.max_output_len, n)
    if math.isinf(config.request_rate):
        arrivals = np.zeros(n)
    else:
        gaps = rng.gamma(config.burstiness, 1.0 / (config.request_rate * config.burstiness), n)
        arrivals = np.cumsum(gaps) - gaps[0]  # the first request goes at once
    adapters = _zipf(rng, config.num_adapters, config.zipf_alpha, n) if config.num_adapters else None
    requests = []
    for i in range(n):
        if adapters is None:
            tenant, adapter = tenant_name(i % config.num_tenants), None
        else:
            j = int(adapters[i])
            tenant, adapter = adapter_owner(j, config.num_tenants), adapter_name(j)
        prompt = rng.integers(FIRST_TOKEN, config.vocab_size, int(prompt_lens[i])).tolist()
        requests.append(BenchRequest(i, float(arrivals[i]), tenant, adapter, prompt, int(output_lens[i])))
    return requests


def _lengths(rng: np.random.Generator, dist: Distribution, mean: int, maximum: int, n: int) -> np.ndarray:
    if dist == "fixed":
        return np.full(n, min(mean, maximum), dtype=np.int64)
    # log-normal with the given mean: mu = ln(mean) - sigma^2 / 2
    values = rng.lognormal(math.log(mean) - LONGTAIL_SIGMA**2 / 2, LONGTAIL_SIGMA, n)
    return np.clip(np.rint(values), 1, maximum).astype(np.int64)


def _zipf(rng: np.random.Generator, num: int, alpha: float, n: int) -> np.ndarray:
    """Adapter indices: index k-1 with probability proportional to 1 / k^alpha. Popularity
    ranks are shuffled over the indices so that the hottest adapters spread over tenants."""
    weights = 1.0 / np.arange(1, num + 1) ** alpha
    ranks = rng.choice(num, size=n, p=weights / weights.sum())
    return rng.permutation(num)[ranks]

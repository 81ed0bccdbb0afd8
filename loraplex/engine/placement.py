"""Where prefill and decode run on a machine's GPUs for a workload and its latency targets
(issue 23; DistServe's placement): colocated (every GPU a whole engine, requests shared out) or
disaggregated P:D (P GPUs prefill, D decode, each request's KV sent between them). Each choice's
goodput, the highest arrival rate at which `attainment` of requests meet both the time to first
token and the time per output token targets, comes from a simulation of its steps on a virtual
clock with a step-time model; the placement with the highest goodput wins.

The step-time model (StepModel) is a roofline of the measured figures: a step reads the weights
once (H100, Llama-3-8B bf16: 15 GB, 5.0 ms at 3.0 TB/s; the engine's decode step at batch 1
measured 5.8 ms), each decoding request's KV (128 KiB a token), each distinct adapter once, and
computes 2 x parameters FLOPs a prompt token (a 1,500-token prompt step took 38-40 ms in the
fairness benchmark: about 26 us a token). A colocated step that computes prompt tokens beside
decodes costs the prompt's compute plus the decodes' reads (the weights read once for both).
DistServe's point shows in it: long prompts stretch the colocated decodes' steps (TPOT), while
a prefill GPU's queue (TTFT) grows with prompt tokens alone."""

from __future__ import annotations

import heapq
import logging
import math
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepModel:
    """Seconds a step takes on one GPU (defaults: H100, Llama-3-8B shape, bf16, rank-16 adapters
    on all seven projections)."""

    weight_read_s: float = 5.8e-3
    """A step's fixed cost: the weights read once, and the launches (batch-1 decode step)."""
    kv_bytes_per_token: float = 128 * 1024
    adapter_bytes: float = 84e6
    bandwidth: float = 3.0e12
    """Bytes a second the GPU reads (a device copy's rate)."""
    prompt_token_s: float = 26e-6
    """Compute of one prompt token (2 x 8B FLOPs at about 600 TFLOP/s)."""
    row_s: float = 20e-6
    """A decode row's own cost beyond its KV (its share of the GEMMs and sampling)."""
    link_bandwidth: float = 150e9
    """Bytes a second between two GPUs (NVLink, as the KV transfer achieves it)."""

    def step(self, prompt_tokens: int, decode_contexts: list[int], num_adapters: int = 0) -> float:
        read_bytes = sum(decode_contexts) * self.kv_bytes_per_token + num_adapters * self.adapter_bytes
        reads = read_bytes / self.bandwidth
        compute = prompt_tokens * self.prompt_token_s
        return max(self.weight_read_s, compute) + reads + len(decode_contexts) * self.row_s

    def transfer(self, prompt_tokens: int) -> float:
        return prompt_tokens * self.kv_bytes_per_token / self.link_bandwidth


@dataclass(frozen=True)
class Workload:
    """Poisson arrivals; prompt lengths log-normal around `prompt_len` (long-tailed, capped at
    `max_prompt_len`); `output_len` tokens each; each request's adapter drawn by Zipf 1.0 from
    `num_adapters` (0: none)."""

    name: str
    prompt_len: int
    output_len: int
    max_prompt_len: int = 8192
    num_adapters: int = 0
    sigma: float = 0.6
    """Spread of the log-normal prompt lengths."""


LONG_PROMPTS = Workload("long prompts (issue 23's: 2K long-tailed, 256 out, 1,000 adapters)", 2048, 256,
                        num_adapters=1000)
"""Issue 23's workload: `loraplex bench placement`'s first, and `serve --disaggregate auto`'s."""


@dataclass(frozen=True)
class Targets:
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9
    """The share of requests that must meet both (DistServe's SLO attainment)."""


@dataclass(frozen=True)
class Placement:
    num_prefill: int
    """0: colocated (every GPU a whole engine)."""
    num_decode: int

    @property
    def name(self) -> str:
        return "colocated" if self.num_prefill == 0 else f"{self.num_prefill}:{self.num_decode}"


@dataclass
class Choice:
    placement: Placement
    goodput: dict[str, float] = field(default_factory=dict)
    """Each placement's name -> its goodput (requests a second)."""
    reason: str = ""


DURATION_S = 60.0
"""Seconds of arrivals a simulation runs (at least MIN_REQUESTS): long enough that a rate past
what the GPUs sustain shows as a growing queue, not as a burst they absorb."""
MIN_REQUESTS = 200


def candidates(num_gpus: int) -> list[Placement]:
    """Colocated, and every split of the GPUs into P prefill and D decode GPUs."""
    return [Placement(0, num_gpus)] + [Placement(p, num_gpus - p) for p in range(1, num_gpus)]


def choose(workload: Workload, targets: Targets, num_gpus: int = 2, model: StepModel | None = None,
           duration_s: float = DURATION_S, seed: int = 0) -> Choice:
    """The placement with the highest goodput, each candidate's goodput, and why (logged)."""
    model = model or StepModel()
    goodput = {p.name: max_goodput(p, workload, targets, model, duration_s, seed)
               for p in candidates(num_gpus)}
    best = max(candidates(num_gpus), key=lambda p: (goodput[p.name], p.num_prefill == 0))
    others = ", ".join(f"{name} {rate:.2f}" for name, rate in goodput.items() if name != best.name)
    reason = (f"{workload.name}: {best.name} serves {goodput[best.name]:.2f} req/s within TTFT "
              f"{targets.ttft_s:g} s and TPOT {targets.tpot_s * 1e3:g} ms at {targets.attainment:.0%} "
              f"attainment (others: {others})")
    logger.info("placement: %s", reason)
    return Choice(best, goodput, reason)


def max_goodput(placement: Placement, workload: Workload, targets: Targets, model: StepModel,
                duration_s: float = DURATION_S, seed: int = 0) -> float:
    """The highest arrival rate (bisection, to 2%) at which the placement meets the targets."""
    low, high = 0.0, 1.0
    while attains(placement, workload, targets, model, high, duration_s, seed):
        low, high = high, high * 2
        if high > 1e4:
            return math.inf
    while high - low > 0.02 * high:
        middle = (low + high) / 2
        low, high = (middle, high) if attains(placement, workload, targets, model, middle, duration_s, seed) \
            else (low, middle)
    return low


def attains(placement: Placement, workload: Workload, targets: Targets, model: StepModel, rate: float,
            duration_s: float = DURATION_S, seed: int = 0) -> bool:
    ttft, tpot = simulate(placement, workload, model, rate, duration_s, seed)
    met = (ttft <= targets.ttft_s) & (tpot <= targets.tpot_s)
    return float(met.mean()) >= targets.attainment


def simulate(placement: Placement, workload: Workload, model: StepModel, rate: float,
             duration_s: float = DURATION_S, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Each request's TTFT and TPOT (seconds) for `duration_s` of arrivals at `rate` requests a
    second over the placement's GPUs, shared out round robin over the GPUs that take them."""
    num_requests = max(MIN_REQUESTS, int(rate * duration_s))
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    drawn = rng.lognormal(math.log(workload.prompt_len), workload.sigma, num_requests)
    prompts = np.clip(drawn, 1, workload.max_prompt_len).astype(int)
    adapters = _zipf(rng, workload.num_adapters, num_requests)
    requests = [_Sim(i, float(arrivals[i]), int(prompts[i]), workload.output_len, int(adapters[i]))
                for i in range(num_requests)]
    if placement.num_prefill == 0:
        for gpu in range(placement.num_decode):
            _colocated(requests[gpu::placement.num_decode], model)
    else:
        for gpu in range(placement.num_prefill):
            _prefill(requests[gpu::placement.num_prefill], model)
        handed = sorted(requests, key=lambda r: r.ready)
        for gpu in range(placement.num_decode):
            _decode(handed[gpu::placement.num_decode], model)
    ttft = np.array([r.first - r.arrival for r in requests])
    tpot = np.array([(r.done - r.first) / max(r.output - 1, 1) for r in requests])
    return ttft, tpot


PREFILL_BUDGET = 8192
"""Prompt tokens one step computes at most (max_num_batched_tokens)."""
MAX_RUNNING = 256
"""Requests a GPU decodes at once (max_num_seqs)."""


@dataclass
class _Sim:
    index: int
    arrival: float
    prompt: int
    output: int
    adapter: int
    computed: int = 0
    generated: int = 0
    first: float = math.inf
    ready: float = math.inf
    """When its KV is on a decode GPU (disaggregated)."""
    done: float = math.inf


def _colocated(requests: list[_Sim], model: StepModel) -> None:
    """One engine: each step decodes every running request and computes up to the budget of the
    oldest prompts (chunked prefill), as the engine's scheduler does."""
    now, waiting, running = 0.0, list(requests), []
    while waiting or running:
        if not running and waiting and waiting[0].arrival > now:
            now = waiting[0].arrival
        arrived = [r for r in waiting if r.arrival <= now]
        budget, chunk = PREFILL_BUDGET - len(running), 0
        prefilling = []
        for request in arrived:
            if budget <= 0 or len(running) + len(prefilling) >= MAX_RUNNING:
                break
            take = min(request.prompt - request.computed, budget)
            request.computed += take
            budget, chunk = budget - take, chunk + take
            prefilling.append(request)
        contexts = [r.prompt + r.generated for r in running]
        adapters = {r.adapter for r in running + prefilling if r.adapter >= 0}
        now += model.step(chunk, contexts, len(adapters))
        for request in running:
            request.generated += 1
        for request in prefilling:
            if request.computed == request.prompt:
                waiting.remove(request)
                request.first, request.generated = now, 1
                running.append(request)
        for request in [r for r in running if r.generated >= r.output]:
            request.done = now
            running.remove(request)


def _prefill(requests: list[_Sim], model: StepModel) -> None:
    """A prefill GPU: prompts first come first served, the budget a step; a request's KV is sent
    once its prompt is done (its first token sampled there)."""
    now, waiting = 0.0, list(requests)
    while waiting:
        if waiting[0].arrival > now:
            now = waiting[0].arrival
        budget, chunk, finished = PREFILL_BUDGET, 0, []
        for request in waiting:
            if request.arrival > now or budget <= 0:
                break
            take = min(request.prompt - request.computed, budget)
            request.computed += take
            budget, chunk = budget - take, chunk + take
            if request.computed == request.prompt:
                finished.append(request)
        adapters = {r.adapter for r in finished if r.adapter >= 0}
        now += model.step(chunk, [], len(adapters))
        for request in finished:
            waiting.remove(request)
            request.first = now
            request.ready = now + model.transfer(request.prompt)


def _decode(requests: list[_Sim], model: StepModel) -> None:
    """A decode GPU: every request whose KV has arrived decodes in each step."""
    now, pending, running = 0.0, [(r.ready, r.index, r) for r in requests], []
    heapq.heapify(pending)
    while pending or running:
        if not running and pending[0][0] > now:
            now = pending[0][0]
        while pending and pending[0][0] <= now and len(running) < MAX_RUNNING:
            request = heapq.heappop(pending)[2]
            request.generated = 1
            running.append(request)
        contexts = [r.prompt + r.generated for r in running]
        now += model.step(0, contexts, len({r.adapter for r in running if r.adapter >= 0}))
        for request in running:
            request.generated += 1
        for request in [r for r in running if r.generated >= r.output]:
            request.done = now
            running.remove(request)


def _zipf(rng: np.random.Generator, num_adapters: int, count: int) -> np.ndarray:
    if num_adapters <= 0:
        return np.full(count, -1)
    weights = 1.0 / np.arange(1, num_adapters + 1)
    return rng.choice(num_adapters, size=count, p=weights / weights.sum())

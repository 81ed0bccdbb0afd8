"""The engine's scheduling of adapter slots on a virtual clock: the real Scheduler, BlockManager,
VtcPolicy and AdapterCache (host tier and device slots, LRU), fed the serving benchmark's
requests (`serve_workload.make_workload`, same seed, same Zipf adapters and tenants), with the
model, the loader's reads and the slot copies replaced by a step-time model and fixed latencies.
It runs on a CPU in seconds and answers what the H100 runs cannot isolate: how long requests wait
for a device slot, and why.

The engine loop is the CUDA engine's (async scheduling): step N+1 is planned and launched
while step N runs; step N's tokens reach the host (first tokens, finishes) when it ends, so a
finished request's slot frees at the plan after that. A host load takes `host_load_ms` on one
worker (one at a time, as the loader thread); a slot copy takes `slot_copy_ms` and starts after
the steps already launched (the side stream waits for them), and the scheduler sees it done at
the first plan after that. A step that runs eagerly (`StepModel.eager_floor_ms`) holds the host
for its whole duration, its kernel launches being what takes the time, so the next plan is made
when it ends (as the CUDA engine's scheduler_delay_factor measures a prompt step).

Step time (`StepModel`), in ms: base + per_decode x decode rows + per_prefill_token x prompt
tokens + per_sampled_token x tokens sampled (+ per_adapter x distinct adapters, and at least
eager_floor for a step with prompt tokens: both 0 by default, the defaults below; the values
calibrated to the H100 pool runs of 2026-11-28 are in studies/results/serving-sim-pool-h100.md).
- per_decode 0.062 and 6.8 of the base: a least-squares line through the H100's decode steps
  with one rank-16 adapter a request (bench/results/decode-nvidia-h100-80gb-hbm3.json, batch 1
  to 128: 6.59, 7.53, 8.96, 10.76, 14.79 ms);
- per_prefill_token 0.030: the same file's prefill times over prompt tokens (0.026 to 0.033 ms
  a token for batches of 8 to 128 prompts of 512 tokens);
- the other 3.2 of the base and per_sampled_token 0.10: what serving through HTTP adds (the
  server's detokenizing, SSE and JSON share one GIL with the engine: 0.33 to 0.55 ms of server
  CPU a token in bench/results/serve-h100), fitted by a grid over (base, per_sampled_token) to
  the mean TPOT of the five one-adapter rate runs (serve-rate-1-*.json, where no request waits
  for a slot; rms error 12%: the measured TPOT is not monotone in the rate, 17.0, 22.6, 27.0,
  25.2, 23.4 ms against 16.9, 20.2, 22.1, 24.1, 27.3 simulated);
- `request_overhead_ms` 70 (HTTP, keys, tokenizing before the scheduler sees a request): the
  mean gap between those runs' measured and simulated TTFT p50.
The runs that the simulation is checked against (serve-poisson-1000 and -32, serve-rate-1000-*)
took no part in the fit.

The analytic slot demand: with unlimited slots, requests for adapter k arrive as a Poisson
stream of rate lambda_k = rate x p_k (p_k the Zipf probability) and each runs for D seconds, so
(M/G/inf) the chance that adapter k has a request running is 1 - exp(-lambda_k D), and the mean
number of adapters with a request running is the sum over k. Above the number of slots, some
requests must wait for one: `analytic_slot_shortage` gives the chance that the slots are
all busy and the share of arrivals that find no slot for their adapter."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from loraplex.benchmarks.serve_workload import BenchRequest, WorkloadConfig, make_workload
from loraplex.engine.adapter_cache import AdapterCache, Wait
from loraplex.engine.block_manager import BlockManager, HostBlockPool
from loraplex.engine.plan import StepPlan
from loraplex.engine.policy import FcfsPolicy, VtcPolicy
from loraplex.engine.request import Request
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.tenants import TenantTable
from loraplex.engine_config import SchedulerConfig
from loraplex.types import SamplingParams

MAX_DRAIN_S = 600.0
"""A run that has not ended this long after its last arrival is stuck (it raises)."""
ADAPTER_BYTES = 83_886_080
"""A rank-16 adapter on all seven projections of Llama-3-8B in bf16 (the H100's slot size)."""
SLOT_BLOCKS = ADAPTER_BYTES // (2 << 20)
"""Pages (KV blocks of 2 MiB: 16 tokens of Llama-3-8B) that such a slot takes in the pool."""
MIXED_TOKEN_BUCKETS = (64, 128, 256, 512, 1024)
"""loraplex/engine/cuda_graphs.py's padded token counts of mixed-step graphs."""


@dataclass(frozen=True)
class StepModel:
    """Wall time of one engine step, in ms (sources in the module docstring)."""

    base_ms: float = 10.0
    per_decode_ms: float = 0.062
    per_prefill_token_ms: float = 0.030
    per_sampled_token_ms: float = 0.10
    per_swapped_out_block_ms: float = 0.0
    """A KV block copied to the host pool before the step's compute may reuse it (2 MiB of
    Llama-3-8B at the H100's 52 GB/s: 0.040; the serving runs swap too rarely to count)."""
    per_adapter_ms: float = 0.0
    """A distinct adapter among the step's rows (0: the decode line's per_decode_ms includes
    one adapter a row). The H100's decode graphs, batch 1 to 128, one rank-16 adapter a request
    against none: 0.76 to 4.56 ms more, about 0.03 ms an adapter
    (bench/results/decode-nvidia-h100-80gb-hbm3.json; studies/serving_sim_pool.py fits it)."""
    eager_floor_ms: float = 0.0
    """The least a step that computes prompt tokens takes: such a step runs eagerly, bound by
    the host's kernel launches, while pure decode steps replay CUDA graphs (0: no floor, as if
    every step replayed a graph). The H100, Llama-3-8B shape, 64 rank-16 adapters: 42.6 ms for
    32 decodes and a 256-token prompt, 15 ms of it kernels (scripts/profile-mixed-steps.py).
    With a floor the simulated engine delays prompts as a graph-replaying engine does
    (SchedulerConfig.scheduler_delay_factor)."""

    mixed_graph_tokens: int = 0
    """The most tokens (prompt tokens, decode rows and the padding of both) of a step with prompt
    tokens that replays a mixed-step CUDA graph (EngineConfig.mixed_step_graphs: 1,024, padded as
    `mixed_padding` says): such a step has no eager floor, does not hold the host, and computes
    its padded tokens; larger steps run eagerly. 0: every step with prompt tokens runs eagerly
    (mixed-step graphs off)."""

    per_mixed_token_ms: float | None = None
    """A token of a mixed-step graph beyond its decode rows (its prompt tokens and padding; None:
    per_prefill_token_ms). Fitted to the H100 serving run with mixed-step graphs, where small
    steps cost less than a large prefill's per-token rate predicts
    (studies/results/serving-sim-mixed-graphs-h100.md)."""

    mixed_graph_seqs: tuple[int, ...] = (8, 32, 128)
    """The padded sequence counts of mixed-step graphs: cuda_graphs.MIXED_SEQ_BUCKETS below
    max_num_seqs and max_num_seqs itself (the serving runs': 128)."""

    def mixed_padding(self, plan: StepPlan) -> tuple[int, int] | None:
        """The padded (tokens, sequences) of the mixed-step graph `plan` replays (None: it has no
        prompt tokens or runs eagerly), by the rule of CudaGraphs.mixed_padding with the
        sequence buckets of `mixed_graph_seqs`."""
        num_seqs, num_tokens = len(plan.num_scheduled_tokens), sum(plan.num_scheduled_tokens)
        if not self.mixed_graph_tokens or num_tokens == num_seqs:
            return None
        seqs = next((s for s in self.mixed_graph_seqs if s >= num_seqs), None)
        if seqs is None:
            return None
        buckets = [t for t in MIXED_TOKEN_BUCKETS if t <= self.mixed_graph_tokens]
        tokens = next((t for t in buckets if t >= num_tokens + seqs - num_seqs and t > seqs), None)
        return None if tokens is None else (tokens, seqs)

    def is_eager(self, plan: StepPlan) -> bool:
        """Whether `plan` runs eagerly with the host's launches as its bound (the host makes the
        next plan when it ends)."""
        return (self.eager_floor_ms > 0 and any(n > 1 for n in plan.num_scheduled_tokens)
                and self.mixed_padding(plan) is None)

    def step_s(self, plan: StepPlan, num_adapters: int = 0) -> float:
        """`plan`'s wall time in seconds; `num_adapters`: the distinct adapters of its rows."""
        decodes = sum(1 for n in plan.num_scheduled_tokens if n == 1)
        prefill = sum(n for n in plan.num_scheduled_tokens if n > 1)
        per_prompt_token = self.per_prefill_token_ms
        padded = self.mixed_padding(plan)
        if padded is not None:  # the graph computes its padding as prompt tokens
            prefill = padded[0] - decodes
            if self.per_mixed_token_ms is not None:
                per_prompt_token = self.per_mixed_token_ms
        device_ms = (self.base_ms + self.per_decode_ms * decodes + per_prompt_token * prefill
                     + self.per_adapter_ms * num_adapters + self.per_sampled_token_ms * sum(plan.samples)
                     + self.per_swapped_out_block_ms * len(plan.swap_out))
        floor = self.eager_floor_ms if prefill and padded is None else 0.0
        return max(device_ms, floor) / 1000


@dataclass(frozen=True)
class SlotSimConfig:
    """The H100 serving run's engine (synthetic_server's defaults) unless stated."""

    workload: WorkloadConfig | None = None
    """What `run()` serves (None: only `serve` with a list of requests)."""
    num_slots: int = 32
    """Fixed slots: the device slots. With `pool`: the slots whose memory the pool has beside
    num_kv_blocks (the same memory as that many fixed slots)."""
    pool: bool = False
    """One pool of pages for KV blocks and adapters (issue 27): num_kv_blocks + (1 + num_slots)
    x SLOT_BLOCKS pages; adapters resident as memory allows (at most `max_loras`), idle ones
    giving their pages back when KV runs short."""
    max_loras: int | None = None
    """With `pool`: the cap on resident adapters (None: the pool's memory alone)."""
    max_host_adapters: int | None = None
    """Host tier size in adapters (default: twice the slots, the engine's default)."""
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 8192
    num_kv_blocks: int = 25444
    block_size: int = 16
    num_host_blocks: int = 2048
    """The swap pool: 4 GiB of 2 MiB blocks."""
    policy: str = "vtc"
    fairness_bound: float = 4096.0
    max_capped_prefill_tokens: int = 0
    """VTC's prompt-chunk cap (SchedulerConfig.max_capped_prefill_tokens; 0: none)."""
    hold_places_for_loading: bool = False
    """SchedulerConfig.hold_places_for_loading."""
    fairness_kv_headroom: float = 0.0
    """SchedulerConfig.fairness_kv_headroom."""
    fairness_patience_tokens: int = SchedulerConfig.fairness_patience_tokens
    """SchedulerConfig.fairness_patience_tokens."""
    scheduler_delay_factor: float = 1.0
    """SchedulerConfig.scheduler_delay_factor (it acts only with the step model's eager floor)."""
    host_load_ms: float = 40.0
    """One adapter read into the host tier (the synthetic server copies 84 MB into fresh pinned
    memory: not measured on its own; the default is an estimate, see the sensitivity runs)."""
    num_load_threads: int = 1
    """Host loads at once (the engine's adapter_cache.LOAD_THREADS is 2; 1 keeps the earlier
    studies' single loader). The parts of loads that hold the engine (host_load_holds_engine)
    do not overlap: they hold the GIL, which more threads do not multiply."""
    host_load_holds_engine: float = 0.0
    """The share of a host load, from its start, during which the engine loop cannot plan or
    launch (the loader thread holding the GIL; 0: none, as if the load ran beside it). The H100
    serving runs of 2026-11-28 suggest most of it: their loader thread spent 110 to 210 ms of CPU
    a host load, and the steps of the 1,000-adapter runs took three times the one-adapter runs'
    while the loads of a run's first seconds ran (studies/results/serving-sim-pool-h100.md)."""
    slot_copy_ms: float = 4.0
    """84 MB host to device at about 20 GB/s."""
    request_overhead_ms: float = 70.0
    """From a request's sending to its arrival in the scheduler (HTTP, keys, tokenizing)."""
    step: StepModel = field(default_factory=StepModel)


class VirtualWorker:
    """An executor of `num_threads` workers on a virtual clock: a job submitted at `now` starts
    when a worker is free (and not before `not_before()`), takes `latency_s`, and its future is
    done once `run_until` passes its end. The first `serial_s` of each job holds one lane that all
    workers share (the GIL): a job starts only once the previous job's serial part has ended."""

    def __init__(self, clock: Callable[[], float], latency_s: float,
                 not_before: Callable[[], float] = lambda: 0.0, num_threads: int = 1,
                 serial_s: float = 0.0) -> None:
        self._clock, self._latency_s, self._not_before = clock, latency_s, not_before
        self._busy_until = [0.0] * num_threads  # each thread's, as a heap
        self._serial_s, self._serial_free = serial_s, 0.0
        self._jobs: list[tuple[float, int, Future, Callable, tuple]] = []
        self._count = 0

    def submit(self, fn: Callable, /, *args: Any) -> Future:
        start = max(self._clock(), self._busy_until[0], self._not_before(), self._serial_free)
        self._serial_free = start + self._serial_s
        end = start + self._latency_s
        heapq.heapreplace(self._busy_until, end)
        future: Future = Future()
        heapq.heappush(self._jobs, (end, self._count, future, fn, args))
        self._count += 1
        return future

    def run_until(self, t: float) -> None:
        while self._jobs and self._jobs[0][0] <= t:
            _, _, future, fn, args = heapq.heappop(self._jobs)
            try:
                future.set_result(fn(*args))
            except Exception as exc:  # noqa: BLE001 - the cache reads it from the future
                future.set_exception(exc)

    def busy_intervals(self) -> list[tuple[float, float]]:
        """(start, end) of the jobs not yet done."""
        return [(end - self._latency_s, end) for end, *_ in self._jobs]

    @property
    def next_done(self) -> float:
        return self._jobs[0][0] if self._jobs else math.inf

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._jobs.clear()


@dataclass(frozen=True)
class _StandInAdapter:
    """What the cache reads of a loaded adapter: its digest and size."""

    digest: str
    num_bytes: int = ADAPTER_BYTES


class _StandInSlots:
    """Device slot buffers that hold nothing (the copy's time is the worker's)."""

    device = torch.device("cpu")

    page_bytes = ADAPTER_BYTES // SLOT_BLOCKS
    blocks_per_page = 1

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots

    def pages_for(self, adapter: _StandInAdapter) -> int:
        return SLOT_BLOCKS

    def own_pages_of(self, slot: int, count: int) -> list[int]:
        return list(range((slot - 1) * SLOT_BLOCKS, (slot - 1) * SLOT_BLOCKS + count))

    def load(self, slot: int, adapter: _StandInAdapter, pages: list[int]) -> None:
        pass


@dataclass
class _Timing:
    arrival_s: float
    admitted_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    token_s: list[float] = field(default_factory=list)
    """When each output token reached the host."""


class SlotSimulation:
    def __init__(self, config: SlotSimConfig) -> None:
        self.config = config
        self.now = 0.0
        self._device_free_at = 0.0  # when the last launched step ends
        clock = lambda: self.now  # noqa: E731
        self.loads = VirtualWorker(clock, config.host_load_ms / 1000, num_threads=config.num_load_threads,
                                   serial_s=config.host_load_holds_engine * config.host_load_ms / 1000)
        self.copies = VirtualWorker(clock, config.slot_copy_ms / 1000, lambda: self._device_free_at)
        max_host = (config.max_host_adapters or 2 * config.num_slots) * ADAPTER_BYTES
        if config.pool:
            num_pages = config.num_kv_blocks + (1 + config.num_slots) * SLOT_BLOCKS
            self.blocks = BlockManager(num_pages, config.block_size, enable_prefix_caching=True)
            self.adapters = AdapterCache(
                _StandInSlots(num_pages // SLOT_BLOCKS - 1), _StandInAdapter, lambda a: a, max_host,
                ADAPTER_BYTES, blocks=self.blocks, slot_blocks=SLOT_BLOCKS, max_resident=config.max_loras,
                load_worker=self.loads, copy_worker=self.copies)
        else:
            self.blocks = BlockManager(config.num_kv_blocks, config.block_size, enable_prefix_caching=True)
            self.adapters = AdapterCache(_StandInSlots(config.num_slots), _StandInAdapter, lambda a: a,
                                         max_host, ADAPTER_BYTES, load_worker=self.loads,
                                         copy_worker=self.copies)
        tenants = TenantTable()
        policy = VtcPolicy(tenants, config.fairness_bound) if config.policy == "vtc" else FcfsPolicy(tenants)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            scheduling_policy=config.policy, fairness_bound=config.fairness_bound,
                            max_capped_prefill_tokens=config.max_capped_prefill_tokens,
                            hold_places_for_loading=config.hold_places_for_loading,
                            fairness_kv_headroom=config.fairness_kv_headroom,
                            fairness_patience_tokens=config.fairness_patience_tokens,
                            scheduler_delay_factor=config.scheduler_delay_factor),
            self.blocks, self.adapters, policy, HostBlockPool(config.num_host_blocks), clock=clock)
        self.scheduler.delays_prompts = config.step.eager_floor_ms > 0 and not config.step.mixed_graph_tokens
        self.num_runs = 0

    def run(self, workload: WorkloadConfig | None = None, *, offline: bool = False) -> dict[str, Any]:
        """Serve `workload` (default: the config's) to its last request, from the state that
        earlier runs left (resident adapters, tenants' counters), as one server serves the
        benchmark's runs one after another. `offline`: through the engine directly, each request
        in the scheduler at its arrival (no request_overhead_ms). Returns the run's figures."""
        arrivals = make_workload(workload or self.config.workload)
        self.serve(arrivals, offline=offline)
        return self._summary(arrivals)

    def preload(self, adapters: Collection[str]) -> None:
        """Read `adapters` into host memory and copy them into device slots before the next run
        (virtual time passes), as a benchmark that serves them before its timed run; they stay
        resident, idle, until evicted."""
        pending = list(dict.fromkeys(adapters))
        while pending:
            self.adapters.poll()
            for adapter in list(pending):
                if not isinstance(self.adapters.acquire(adapter), Wait):
                    self.adapters.release(adapter)
                    pending.remove(adapter)
            if pending:
                wake = min(self.loads.next_done, self.copies.next_done)
                if math.isinf(wake):
                    raise RuntimeError(f"adapters {pending} cannot be made resident")
                self.now = max(wake, self.now)  # between runs: no occupancy to count
                self._run_workers()

    def serve(self, arrivals: list[BenchRequest], end_s: float = math.inf, *, offline: bool = False) -> None:
        """Serve `arrivals` (by arrival time) from the state that earlier runs left, until the
        last ends or `end_s` seconds after the run's start (requests unfinished then are left
        as they are; `self.timings` has what each got)."""
        self._start_run()
        next_arrival = 0
        delay = 0.0 if offline else self.config.request_overhead_ms / 1000
        arrival_s = [self.start_s + a.arrival_s + delay for a in arrivals]  # in the scheduler
        in_flight: tuple[list[Request], float] | None = None
        unfinished: set[str] = set()
        while (next_arrival < len(arrivals) or unfinished) and self.now < self.start_s + end_s:
            while next_arrival < len(arrivals) and arrival_s[next_arrival] <= self.now:
                unfinished.add(self._add(arrivals[next_arrival]))
                next_arrival += 1
            self._run_workers()
            held = self._engine_held_until()
            if held > self.now:
                self._advance_clock(held)
                continue
            if self.now > arrival_s[-1] + MAX_DRAIN_S:
                raise RuntimeError(f"{len(unfinished)} requests unfinished {MAX_DRAIN_S:.0f} s after "
                                   "the last arrival")
            plan = self.scheduler.schedule()
            self._slot_waiters.update(
                r for r, wait in self.scheduler.adapter_waits.items() if wait is Wait.NO_SLOT)
            launched = None
            if not plan.is_empty:
                self._note_admitted(plan)
                sampling = self.scheduler.advance(plan)
                end = max(self.now, self._device_free_at) + self.config.step.step_s(
                    plan, self._num_adapters(plan))
                self._device_free_at = end
                launched = (sampling, end)
                self.num_steps += 1
            collected = in_flight is not None
            if collected:
                self._advance_clock(in_flight[1])
                unfinished -= self._commit(*in_flight)
            in_flight = launched
            if launched is not None and self.config.step.is_eager(plan):
                self._advance_clock(max(launched[1], self.now))  # its launches hold the host
            if launched is None and not collected:  # only loads or arrivals to wait for
                upcoming = arrival_s[next_arrival] if next_arrival < len(arrivals) else math.inf
                wake = min(upcoming, self.loads.next_done, self.copies.next_done)
                if math.isinf(wake):
                    if unfinished:
                        raise RuntimeError(f"{len(unfinished)} requests wait for nothing that will happen")
                    break
                self._advance_clock(max(wake, self.now))

    def _engine_held_until(self) -> float:
        """When the host load running now stops holding the engine loop (or now)."""
        share = self.config.host_load_holds_engine * self.config.host_load_ms / 1000
        return max((start + share for start, _ in self.loads.busy_intervals()
                    if start <= self.now < start + share), default=self.now)

    def _num_adapters(self, plan: StepPlan) -> int:
        if not self.config.step.per_adapter_ms:
            return 0
        return len({self.requests[i].adapter for i in plan.request_ids} - {None})

    def _start_run(self) -> None:
        self.num_runs += 1
        self.start_s = self.now
        self.timings: dict[str, _Timing] = {}
        self.requests: dict[str, Request] = {}
        self._slot_waiters: set[str] = set()  # requests that waited for a held slot at some plan
        self.num_steps = 0
        self._loads_before = (self.adapters.num_slot_loads, self.adapters.num_host_loads,
                              self.scheduler.num_preemptions, self._num_fairness_preemptions())
        # Time-weighted occupancy: adapters with a running request, and with any request.
        self._area_running = self._area_needed = 0.0
        self.max_running_adapters = self.max_needed_adapters = 0

    def _add(self, bench: BenchRequest) -> str:
        request_id = f"{self.num_runs}-{bench.index}"
        self.timings[request_id] = _Timing(self.start_s + bench.arrival_s)
        prompt = bench.prompt_token_ids
        request = Request(request_id=request_id, prompt_token_ids=prompt,
                          params=SamplingParams(max_tokens=bench.max_tokens, ignore_eos=True), seed=0,
                          arrival=bench.index, tenant=bench.tenant, adapter=bench.adapter,
                          max_num_tokens=len(prompt) + bench.max_tokens)
        self.scheduler.add(request)
        self.requests[request_id] = request
        return request_id

    def _note_admitted(self, plan: StepPlan) -> None:
        for seq in plan.new:
            timing = self.timings[seq.request_id]
            if timing.admitted_s is None:
                timing.admitted_s = self.now

    def _commit(self, sampling: list[Request], end: float) -> set[str]:
        finished = set()
        for request in sampling:
            if request.is_finished:
                continue
            self.scheduler.commit(request, 1)
            timing = self.timings[request.request_id]
            timing.token_s.append(end)
            if timing.first_token_s is None:
                timing.first_token_s = end
            if request.num_output_tokens >= request.params.max_tokens:
                self.scheduler.finish(request, "length")
                timing.finished_s = end
                finished.add(request.request_id)
        return finished

    def _num_fairness_preemptions(self) -> int:
        return sum(n for (cause, _), n in self.scheduler.preemptions.items() if cause == "fairness")

    def _run_workers(self) -> None:
        self.loads.run_until(self.now)
        self.copies.run_until(self.now)

    def _advance_clock(self, t: float) -> None:
        """Move to `t`, counting the occupancy of the time in between."""
        dt = t - self.now
        if dt > 0:
            running = len({r.adapter for r in self.scheduler.running if r.adapter is not None})
            needed = self.adapters.num_needed
            self._area_running += running * dt
            self._area_needed += needed * dt
            self.max_running_adapters = max(self.max_running_adapters, running)
            self.max_needed_adapters = max(self.max_needed_adapters, needed)
            self.now = t

    def _summary(self, arrivals: list[BenchRequest]) -> dict[str, Any]:
        timings = list(self.timings.values())
        ttft = np.array([t.first_token_s - t.arrival_s for t in timings]) * 1000
        waits = np.array([t.admitted_s - t.arrival_s for t in timings]) * 1000
        running_s = np.array([t.finished_s - t.admitted_s for t in timings])
        tokens = [a.max_tokens for a in arrivals]
        tpot = np.array([(t.finished_s - t.first_token_s) / max(n - 1, 1)
                         for t, n in zip(timings, tokens)]) * 1000
        e2e = np.array([t.finished_s - t.arrival_s for t in timings]) * 1000
        duration = max(t.finished_s for t in timings) - min(t.arrival_s for t in timings)
        num_lora = sum(a.adapter is not None for a in arrivals)
        slot_loads, host_loads, preemptions, fairness_preemptions = (now - before for now, before in zip(
            (self.adapters.num_slot_loads, self.adapters.num_host_loads, self.scheduler.num_preemptions,
             self._num_fairness_preemptions()), self._loads_before))
        elapsed = self.now - self.start_s
        return {
            "completed": len(timings), "duration_s": round(duration, 3),
            "request_throughput": round(len(timings) / duration, 3),
            "output_throughput": round(sum(tokens) / duration, 1),
            "ttft_ms": _percentiles(ttft), "slot_wait_ms": _percentiles(waits),
            "tpot_ms": _percentiles(tpot), "e2e_ms": _percentiles(e2e),
            "mean_running_s": round(float(running_s.mean()), 3),
            "adapter_slot_loads": slot_loads, "adapter_host_loads": host_loads,
            "adapter_slot_hits": max(0, num_lora - slot_loads), "preemptions": preemptions,
            "fairness_preemptions": fairness_preemptions,
            "requests_waited_for_slot": len(self._slot_waiters),
            "num_steps": self.num_steps,
            "adapters_running": {"mean": round(self._area_running / elapsed, 2),
                                 "max": self.max_running_adapters},
            "adapters_needed": {"mean": round(self._area_needed / elapsed, 2),
                                "max": self.max_needed_adapters},
        }


def _percentiles(values: np.ndarray) -> dict[str, float]:
    return {"mean": round(float(values.mean()), 2),
            **{f"p{q}": round(float(np.percentile(values, q)), 2) for q in (50, 90, 99)}}


def simulate(config: SlotSimConfig) -> dict[str, Any]:
    return SlotSimulation(config).run()


def zipf_probabilities(num_adapters: int, alpha: float) -> np.ndarray:
    """Request probability of each popularity rank (as serve_workload draws them)."""
    weights = 1.0 / np.arange(1, num_adapters + 1) ** alpha
    return weights / weights.sum()


def analytic_adapters_running(rate: float, num_adapters: int, alpha: float, running_s: float) -> float:
    """Mean number of adapters with a request running, with unlimited slots (M/G/inf): the sum
    over adapters of 1 - exp(-rate x p_k x running_s)."""
    if num_adapters == 0:
        return 0.0
    lam = rate * zipf_probabilities(num_adapters, alpha)
    return float(np.sum(1.0 - np.exp(-lam * running_s)))


def analytic_slot_shortage(rate: float, num_adapters: int, alpha: float, running_s: float,
                           num_slots: int) -> tuple[float, float]:
    """With unlimited slots (M/G/inf, adapters independent): the chance that `num_slots` or
    more adapters have a request running (N is a sum of independent Bernoullis of chances
    1 - exp(-lambda_k D)), and the share of arrivals that then find every slot busy and their
    own adapter in none: sum_k p_k exp(-lambda_k D) P(N without k >= num_slots), approximated
    by P(N >= num_slots). With `num_slots` slots those requests wait for one to free."""
    p = zipf_probabilities(num_adapters, alpha)
    busy = 1.0 - np.exp(-rate * p * running_s)
    counts = np.zeros(num_adapters + 1)  # counts[j] = P(N = j)
    counts[0] = 1.0
    for chance in busy:
        counts[1:] = counts[1:] * (1 - chance) + counts[:-1] * chance
        counts[0] *= 1 - chance
    full = float(counts[num_slots:].sum())
    return full, float(np.sum(p * (1.0 - busy))) * full


def describe(config: SlotSimConfig) -> dict[str, Any]:
    described = asdict(config)
    described["workload"]["request_rate"] = str(config.workload.request_rate)
    return described

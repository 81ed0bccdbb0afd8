"""The engine's live statistics: one typed snapshot, taken on the engine thread, for metrics,
the admin API and benchmarks."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, fields
from typing import Any

ADAPTER_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Upper bounds, in seconds, of the adapter-wait histogram's buckets (+Inf after them)."""
KV_TRANSFER_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Upper bounds, in seconds, of the KV-transfer histogram's buckets (disaggregated serving)."""


@dataclass
class Histogram:
    """Counts of observations by bucket (Prometheus' cumulative buckets are summed on export)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    """Per bucket, the last one past every bound (+Inf); not cumulative."""
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.total)

    def merged(self, other: Histogram) -> Histogram:
        """Both histograms' observations in one (the same bounds)."""
        if other.bounds != self.bounds:
            raise ValueError("histograms of different buckets cannot be merged")
        counts = [a + b for a, b in zip(self.counts, other.counts)]
        return Histogram(self.bounds, counts, self.total + other.total)


@dataclass(frozen=True)
class SideStats:
    """One side of disaggregated prefill and decode: its queue and its KV pool."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_kv_blocks_used: int
    num_preemptions: int


@dataclass
class TransferStats:
    """KV copied from the prefill side to the decode side since start (each copy of a request's
    prompt blocks, or of a pinned prompt's, is one transfer): the engine's running count, and
    (`snapshot`) what its stats report."""

    num_transfers: int = 0
    num_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    """Summed over the transfers: each from its first copy queued to its last byte."""
    durations: Histogram = field(default_factory=lambda: Histogram(KV_TRANSFER_BUCKETS))
    """Each transfer's seconds."""

    def add(self, num_blocks: int, num_bytes: int, seconds: float) -> None:
        self.num_transfers += 1
        self.num_blocks += num_blocks
        self.num_bytes += num_bytes
        self.seconds += seconds
        self.durations.observe(seconds)

    def snapshot(self) -> TransferStats:
        return TransferStats(self.num_transfers, self.num_blocks, self.num_bytes, self.seconds,
                             self.durations.copy())

    @property
    def bytes_per_second(self) -> float:
        """Over all transfers so far (0 before any)."""
        return self.num_bytes / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    """The most blocks the KV cache can hold: the pool's pages less slot 0's and one adapter's
    (or num_kv_blocks when set); idle adapters give theirs back as it grows."""
    num_kv_blocks_used: int
    num_preemptions: int
    num_lora_slots: int
    adapters_in_slots: tuple[str, ...]
    """Digests of the adapters in device slots."""
    adapters_on_host: tuple[str, ...]
    """Digests of the adapters in the host tier."""
    host_tier_bytes: int
    max_host_tier_bytes: int
    num_adapter_host_loads: int
    """Adapters read into the host tier so far."""
    num_adapter_slot_loads: int
    """Adapters copied into device slots so far."""
    num_generated_tokens: int
    num_prompt_tokens: int
    running_by_tenant: dict[str, int]
    waiting_by_tenant: dict[str, int]
    """Requests waiting per tenant, the swapped ones included."""
    swapped_by_tenant: dict[str, int]
    """Waiting requests whose KV is in the host pool."""
    tenant_service: dict[str, float]
    """Each tenant's service as the scheduling policy counts it ("vtc": prompt tokens + 2 x
    generated tokens, over the weight; empty for "fcfs")."""
    tenant_weights: dict[str, float]
    """Weights set for tenants (the others weigh 1)."""
    preemptions: dict[str, int]
    """Preemptions by "cause:mode": cause kv (blocks ran short), fairness (the policy made room
    for a waiting tenant) or asked; mode swap or recompute (the host pool had no room, or was
    off)."""
    num_host_pool_blocks: int
    num_host_pool_blocks_used: int
    swap_bytes_out: int
    swap_bytes_in: int
    swap_seconds_out: float
    swap_seconds_in: float
    """Time the swap copies took (on their own CUDA stream, beside the steps)."""
    swap_seconds_stalled: float
    """Time the steps waited for swap copies: the device idle time that swapping caused."""
    running_by_adapter: dict[str, int]
    """Running requests per adapter digest (base-model requests are not counted)."""
    waiting_by_adapter: dict[str, int]
    """Waiting requests per adapter digest."""
    prefix_queried_tokens: int = 0
    """Prompt tokens looked up in the prefix cache."""
    prefix_hit_tokens: int = 0
    """Prompt tokens found there (their KV not computed again)."""
    prefix_evicted_blocks: int = 0
    """Cached blocks nobody held, handed out again."""
    num_shared_kv_blocks: int = 0
    """KV blocks held by more than one holder (a shared prefix, counted once)."""
    num_relay_steps: int = 0
    """Decode steps that read shared prefixes once per relay group."""
    num_relay_groups: int = 0
    num_relay_members: int = 0
    """Relay groups, and the requests in them, summed over those steps."""
    pinned_prompts: dict[str, tuple[int, int]] | None = None
    """Each pinned system prompt's key -> (KV blocks it holds, running requests reading them)."""
    pool_page_bytes: int = 0
    """Bytes of a page of the device pool (a KV block)."""
    pool_pages: dict[str, int] | None = None
    """The device pool's pages by kind: "kv" (held by requests and pinned prompts), "adapters"
    (lent to adapter slots, slot 0's included), "free" (cached KV blocks nobody holds among them)."""
    adapter_device_bytes: dict[str, int] | None = None
    """Digest -> device bytes of each resident adapter (its slot's pages)."""
    num_adapter_evictions: int = 0
    """Adapters evicted from the device (for KV, for another adapter, or removed)."""
    max_loras: int | None = None
    """The cap on resident adapters, when one is set."""
    adapter_wait: Histogram | None = None
    """Each ended request's wait for its adapter, in seconds (requests with an adapter)."""
    sides: dict[str, SideStats] | None = None
    """Disaggregated serving: "prefill" and "decode", each side's own figures (the ones above
    are both sides' together); None for a colocated engine."""
    kv_transfers: TransferStats | None = None
    """Disaggregated serving: the KV sent from the prefill side to the decode side."""

    @property
    def kv_cache_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks if self.num_kv_blocks else 0.0

    @property
    def num_lora_resident(self) -> int:
        """Adapters resident on the device now (vllm:lora_requests_info's max_lora)."""
        return len(self.adapters_in_slots)


KEPT_FROM_DECODE = ("tenant_weights", "pool_page_bytes", "max_loras")
"""Figures of disaggregated serving that are the decode side's, not both sides' summed."""


def disaggregated_stats(prefill: EngineStats, decode: EngineStats, num_between: int,
                        transfers: TransferStats) -> EngineStats:
    """One engine's figures for the two sides of disaggregated serving: counts, blocks, tokens
    and per-tenant figures summed (a tenant's service is its prompt tokens, charged on the
    prefill side, plus its generated tokens, on the decode side), adapters resident on either
    side; each side's own queue and KV pool in `sides`. `num_between`: requests handed over
    by the prefill side that the decode side has not queued yet (counted as waiting there)."""
    own = KEPT_FROM_DECODE + ("sides", "kv_transfers")
    merged = {figure.name: _merged(getattr(prefill, figure.name), getattr(decode, figure.name))
              for figure in fields(EngineStats) if figure.name not in own}
    merged.update({name: getattr(decode, name) for name in KEPT_FROM_DECODE})
    merged["num_waiting"] += num_between
    sides = {"prefill": _side(prefill, 0), "decode": _side(decode, num_between)}
    return EngineStats(**merged, sides=sides, kv_transfers=transfers)


def _side(stats: EngineStats, num_between: int) -> SideStats:
    return SideStats(stats.num_running, stats.num_waiting + num_between, stats.num_kv_blocks,
                     stats.num_kv_blocks_used, stats.num_preemptions)


def _merged(first: Any, second: Any) -> Any:
    """Both sides' value of one figure: numbers summed, counts by key summed (a pin's blocks and
    readers pairwise), digests held on either side, histograms merged; None where neither side
    has it."""
    if first is None or second is None:
        return second if first is None else first
    if isinstance(first, Histogram):
        return first.merged(second)
    if isinstance(first, tuple):  # digests
        return tuple(dict.fromkeys(first + second))
    if isinstance(first, dict):
        return {key: _summed(first.get(key), second.get(key)) for key in first | second}
    return first + second


def _summed(first: Any, second: Any) -> Any:
    if first is None or second is None:
        return second if first is None else first
    if isinstance(first, tuple):
        return tuple(a + b for a, b in zip(first, second))
    return first + second

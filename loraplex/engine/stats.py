"""The engine's live statistics: one typed snapshot, taken on the engine thread, for metrics,
the admin API and benchmarks."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class TransferStats:
    """KV copied from the prefill side to the decode side since start (each copy of a request's
    prompt blocks, or of a pinned prompt's, is one transfer)."""

    num_transfers: int
    num_blocks: int
    num_bytes: int
    seconds: float
    """Summed over the transfers."""
    durations: Histogram
    """Each transfer's seconds."""

    @property
    def bytes_per_second(self) -> float:
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


def disaggregated_stats(prefill: EngineStats, decode: EngineStats, num_between: int,
                        transfers: TransferStats) -> EngineStats:
    """One engine's figures for the two sides of disaggregated serving: counts, blocks, tokens
    and per-tenant figures summed (a tenant's service is its prompt tokens, charged on the
    prefill side, plus its generated tokens, on the decode side), adapters resident on either
    side; each side's own queue and KV pool in `sides`. `num_between`: requests handed over
    by the prefill side that the decode side has not queued yet (counted as waiting there)."""
    sides = {"prefill": _side(prefill, 0), "decode": _side(decode, num_between)}
    return EngineStats(
        num_running=prefill.num_running + decode.num_running,
        num_waiting=prefill.num_waiting + decode.num_waiting + num_between,
        num_kv_blocks=prefill.num_kv_blocks + decode.num_kv_blocks,
        num_kv_blocks_used=prefill.num_kv_blocks_used + decode.num_kv_blocks_used,
        num_preemptions=prefill.num_preemptions + decode.num_preemptions,
        num_lora_slots=prefill.num_lora_slots + decode.num_lora_slots,
        adapters_in_slots=_union(prefill.adapters_in_slots, decode.adapters_in_slots),
        adapters_on_host=_union(prefill.adapters_on_host, decode.adapters_on_host),
        host_tier_bytes=prefill.host_tier_bytes + decode.host_tier_bytes,
        max_host_tier_bytes=prefill.max_host_tier_bytes + decode.max_host_tier_bytes,
        num_adapter_host_loads=prefill.num_adapter_host_loads + decode.num_adapter_host_loads,
        num_adapter_slot_loads=prefill.num_adapter_slot_loads + decode.num_adapter_slot_loads,
        num_generated_tokens=prefill.num_generated_tokens + decode.num_generated_tokens,
        num_prompt_tokens=prefill.num_prompt_tokens + decode.num_prompt_tokens,
        running_by_tenant=_summed(prefill.running_by_tenant, decode.running_by_tenant),
        waiting_by_tenant=_summed(prefill.waiting_by_tenant, decode.waiting_by_tenant),
        swapped_by_tenant=_summed(prefill.swapped_by_tenant, decode.swapped_by_tenant),
        tenant_service=_summed(prefill.tenant_service, decode.tenant_service),
        tenant_weights=decode.tenant_weights,
        preemptions=_summed(prefill.preemptions, decode.preemptions),
        num_host_pool_blocks=prefill.num_host_pool_blocks + decode.num_host_pool_blocks,
        num_host_pool_blocks_used=prefill.num_host_pool_blocks_used + decode.num_host_pool_blocks_used,
        swap_bytes_out=prefill.swap_bytes_out + decode.swap_bytes_out,
        swap_bytes_in=prefill.swap_bytes_in + decode.swap_bytes_in,
        swap_seconds_out=prefill.swap_seconds_out + decode.swap_seconds_out,
        swap_seconds_in=prefill.swap_seconds_in + decode.swap_seconds_in,
        swap_seconds_stalled=prefill.swap_seconds_stalled + decode.swap_seconds_stalled,
        running_by_adapter=_summed(prefill.running_by_adapter, decode.running_by_adapter),
        waiting_by_adapter=_summed(prefill.waiting_by_adapter, decode.waiting_by_adapter),
        prefix_queried_tokens=prefill.prefix_queried_tokens + decode.prefix_queried_tokens,
        prefix_hit_tokens=prefill.prefix_hit_tokens + decode.prefix_hit_tokens,
        prefix_evicted_blocks=prefill.prefix_evicted_blocks + decode.prefix_evicted_blocks,
        num_shared_kv_blocks=prefill.num_shared_kv_blocks + decode.num_shared_kv_blocks,
        num_relay_steps=prefill.num_relay_steps + decode.num_relay_steps,
        num_relay_groups=prefill.num_relay_groups + decode.num_relay_groups,
        num_relay_members=prefill.num_relay_members + decode.num_relay_members,
        pinned_prompts=_summed_pins(prefill.pinned_prompts or {}, decode.pinned_prompts or {}),
        pool_page_bytes=decode.pool_page_bytes,
        pool_pages=_summed(prefill.pool_pages or {}, decode.pool_pages or {}),
        adapter_device_bytes=_summed(prefill.adapter_device_bytes or {}, decode.adapter_device_bytes or {}),
        num_adapter_evictions=prefill.num_adapter_evictions + decode.num_adapter_evictions,
        max_loras=decode.max_loras,
        adapter_wait=_merged(prefill.adapter_wait, decode.adapter_wait),
        sides=sides, kv_transfers=transfers,
    )


def _side(stats: EngineStats, num_between: int) -> SideStats:
    return SideStats(stats.num_running, stats.num_waiting + num_between, stats.num_kv_blocks,
                     stats.num_kv_blocks_used, stats.num_preemptions)


def _merged(first: Histogram | None, second: Histogram | None) -> Histogram | None:
    if first is None or second is None:
        return first or second
    return first.merged(second)


def _union(first: tuple[str, ...], second: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(first + second))


def _summed(first: dict, second: dict) -> dict:
    return {key: first.get(key, 0) + second.get(key, 0) for key in first | second}


def _summed_pins(first: dict[str, tuple[int, int]], second: dict[str, tuple[int, int]]
                 ) -> dict[str, tuple[int, int]]:
    """A pin's blocks on both sides, and the running requests reading them on both."""
    return {key: tuple(a + b for a, b in zip(first.get(key, (0, 0)), second.get(key, (0, 0))))
            for key in first | second}

"""The engine's live statistics: one typed snapshot, taken on the engine thread, for metrics,
the admin API and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
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

    @property
    def kv_cache_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks if self.num_kv_blocks else 0.0

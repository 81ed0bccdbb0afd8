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
    running_by_adapter: dict[str, int]
    """Running requests per adapter digest (base-model requests are not counted)."""
    waiting_by_adapter: dict[str, int]
    """Waiting requests per adapter digest."""

    @property
    def kv_cache_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks if self.num_kv_blocks else 0.0

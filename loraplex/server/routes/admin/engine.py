"""The engine's live state."""

from __future__ import annotations

import time
from dataclasses import asdict

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from loraplex.engine.stats import Histogram, TransferStats
from loraplex.server.auth import AdminDep
from loraplex.server.deps import ServicesDep
from loraplex.server.routes.docs import error_responses
from loraplex.server.schemas.admin import (
    AdapterWait,
    EngineSide,
    EngineState,
    KvTransfers,
    PrefixCacheReset,
    ResidentAdapter,
    TenantRequests,
)

router = APIRouter(tags=["Admin: engine"])


@router.get("/engine", response_model=EngineState, summary="Engine state now",
            responses=error_responses(401, 403, 503))
async def get_engine_state(admin: AdminDep, services: ServicesDep) -> EngineState:
    """Requests running, waiting and swapped (per tenant, with its weight and service), KV
    blocks, the device pool's pages by kind (KV, adapters, free), preemptions and swapping,
    adapters in device slots (with their bytes) and in the host tier, loads, evictions and
    requests' waits for their adapters, the generation rate (tokens per second over the last
    few seconds), and the engine's options, memory plan and captured graphs; when prefill and
    decode are disaggregated, each side's queue and KV pool and the KV sent between them."""
    snapshot = await services.monitor.refresh()
    stats, llm = snapshot.stats, services.llm
    names = await run_in_threadpool(services.registry.adapters.names_by_digest, stats.adapters_in_slots)
    tenants = set(stats.running_by_tenant) | set(stats.waiting_by_tenant) | set(stats.tenant_service)
    by_tenant = {t: TenantRequests(running=stats.running_by_tenant.get(t, 0),
                                   waiting=stats.waiting_by_tenant.get(t, 0),
                                   swapped=stats.swapped_by_tenant.get(t, 0),
                                   weight=stats.tenant_weights.get(t, 1.0),
                                   service=stats.tenant_service.get(t, 0.0))
                 for t in sorted(tenants)}
    return EngineState(
        model=services.config.model_id, device=str(llm.device), dtype=str(llm.dtype).removeprefix("torch."),
        max_model_len=llm.max_model_len, vocab_size=llm.model_config.vocab_size,
        shape=asdict(llm.model_config.shape), is_alive=services.engine.is_alive,
        num_requests_running=stats.num_running, num_requests_waiting=stats.num_waiting,
        num_requests_in_flight=services.limiter.num_in_flight,
        requests_by_tenant=by_tenant,
        kv_blocks_used=stats.num_kv_blocks_used, kv_blocks_total=stats.num_kv_blocks,
        kv_cache_usage=stats.kv_cache_usage, num_preemptions=stats.num_preemptions,
        preemptions=stats.preemptions, host_pool_blocks=stats.num_host_pool_blocks,
        host_pool_blocks_used=stats.num_host_pool_blocks_used, swap_bytes_out=stats.swap_bytes_out,
        swap_bytes_in=stats.swap_bytes_in, swap_seconds_out=stats.swap_seconds_out,
        swap_seconds_in=stats.swap_seconds_in, swap_seconds_stalled=stats.swap_seconds_stalled,
        prefix_cache_queries=stats.prefix_queried_tokens, prefix_cache_hits=stats.prefix_hit_tokens,
        prefix_cache_evicted_blocks=stats.prefix_evicted_blocks, kv_blocks_shared=stats.num_shared_kv_blocks,
        relay_steps=stats.num_relay_steps, relay_groups=stats.num_relay_groups,
        relay_members=stats.num_relay_members,
        num_adapter_slots=stats.num_lora_slots, max_loras=stats.max_loras,
        pool_page_bytes=stats.pool_page_bytes, pool_pages=stats.pool_pages or {},
        num_adapter_evictions=stats.num_adapter_evictions, adapter_wait=_adapter_wait(stats.adapter_wait),
        adapters_resident=[ResidentAdapter(digest=digest, names=list(names[digest]),
                                           device_bytes=(stats.adapter_device_bytes or {}).get(digest, 0))
                           for digest in stats.adapters_in_slots],
        num_adapters_on_host=len(stats.adapters_on_host), host_tier_bytes=stats.host_tier_bytes,
        max_host_tier_bytes=stats.max_host_tier_bytes, num_adapter_host_loads=stats.num_adapter_host_loads,
        num_adapter_slot_loads=stats.num_adapter_slot_loads,
        generation_tokens_per_second=snapshot.tokens_per_second,
        num_generated_tokens=stats.num_generated_tokens,
        options=llm.config.options(),
        memory=asdict(llm.memory) | {"num_kv_blocks": llm.memory.num_kv_blocks,
                                     "slot_blocks": llm.memory.slot_blocks},
        cuda_graphs=None if llm.graphs is None else asdict(llm.graphs),
        uptime_s=time.time() - services.started_at,
        sides=None if stats.sides is None else {
            name: EngineSide(num_requests_running=side.num_running, num_requests_waiting=side.num_waiting,
                             kv_blocks_used=side.num_kv_blocks_used, kv_blocks_total=side.num_kv_blocks,
                             num_preemptions=side.num_preemptions)
            for name, side in stats.sides.items()},
        kv_transfers=_kv_transfers(stats.kv_transfers),
    )


@router.post("/engine/reset-prefix-cache", response_model=PrefixCacheReset,
             summary="Forget the cached prompt blocks", responses=error_responses(401, 403, 503))
async def reset_prefix_cache(admin: AdminDep, services: ServicesDep) -> PrefixCacheReset:
    """Drop every cached prompt block that no request holds (registered system prompts stay
    pinned): later requests compute their prompts again. For benchmarks that send the same
    workload twice, as vLLM's `/reset_prefix_cache`."""
    return PrefixCacheReset(dropped_blocks=await services.engine.call(_reset_prefix_cache))


def _reset_prefix_cache(engine) -> int:  # (module level: it crosses to the engine-core process)
    return engine.reset_prefix_cache()


def _kv_transfers(transfers: TransferStats | None) -> KvTransfers | None:
    if transfers is None:
        return None
    return KvTransfers(num_transfers=transfers.num_transfers, num_blocks=transfers.num_blocks,
                       num_bytes=transfers.num_bytes, seconds=transfers.seconds,
                       bytes_per_second=transfers.bytes_per_second)


def _adapter_wait(histogram: Histogram | None) -> AdapterWait | None:
    if histogram is None:
        return None
    bounds = [str(bound) for bound in histogram.bounds] + ["+Inf"]
    return AdapterWait(num_requests=histogram.count, total_seconds=histogram.total,
                       buckets=dict(zip(bounds, histogram.counts)))

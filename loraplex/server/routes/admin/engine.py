"""The engine's live state."""

from __future__ import annotations

import time

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from loraplex.server.auth import AdminDep
from loraplex.server.deps import ServicesDep
from loraplex.server.routes.docs import error_responses
from loraplex.server.schemas.admin import EngineState, ResidentAdapter

router = APIRouter(tags=["Admin: engine"])


@router.get("/engine", response_model=EngineState, summary="Engine state now",
            responses=error_responses(401, 403, 503))
async def get_engine_state(admin: AdminDep, services: ServicesDep) -> EngineState:
    """Requests running, waiting and swapped, KV blocks, adapters in device slots, and the
    generation rate (tokens per second over the last few seconds)."""
    snapshot = await services.monitor.refresh()
    names = await run_in_threadpool(services.registry.adapters.names_by_digest, snapshot.resident_adapters)
    llm = services.llm
    return EngineState(
        model=services.config.model_id, device=str(llm.device), dtype=str(llm.dtype).removeprefix("torch."),
        max_model_len=llm.max_model_len, is_alive=services.engine.is_alive,
        num_requests_running=snapshot.num_running, num_requests_waiting=snapshot.num_waiting,
        num_requests_swapped=snapshot.num_swapped, num_requests_in_flight=services.limiter.num_in_flight,
        kv_blocks_used=snapshot.kv_blocks_used, kv_blocks_total=snapshot.kv_blocks_total,
        kv_cache_usage=snapshot.kv_cache_usage, num_preemptions=snapshot.num_preemptions,
        num_adapter_slots=snapshot.num_adapter_slots,
        adapters_resident=[ResidentAdapter(digest=digest, names=list(names[digest]))
                           for digest in snapshot.resident_adapters],
        num_adapters_loaded=len(snapshot.host_adapters),
        generation_tokens_per_second=snapshot.tokens_per_second,
        num_generated_tokens=snapshot.num_generated_tokens,
        uptime_s=time.time() - services.started_at,
    )

"""System prompts: add, list (with token counts and the KV the engine holds for each), get, delete."""

from __future__ import annotations

from fastapi import APIRouter, Response, status
from starlette.concurrency import run_in_threadpool

from loraplex.registry.records import SystemPromptRecord
from loraplex.server.auth import AdminDep
from loraplex.server.deps import ServicesDep
from loraplex.server.routes.admin.params import NameParam, TenantFilter
from loraplex.server.routes.docs import error_responses
from loraplex.server.schemas.admin import PromptCreate, SystemPrompt
from loraplex.server.services import Services
from loraplex.server.system_prompts import prompt_use, unpin_system_prompts, warm_system_prompt

router = APIRouter(prefix="/prompts", tags=["Admin: system prompts"])


async def _prompt(services: Services, record: SystemPromptRecord,
                  pinned: dict[str, tuple[int, int]] | None = None) -> SystemPrompt:
    """The prompt with its token count and what the engine holds for it (`pinned`: the engine's
    pin figures; sampled now when not given)."""
    if pinned is None:
        pinned = await _pinned(services)
    return SystemPrompt.of(record, await services.codec.count(record.text), *prompt_use(pinned, record))


async def _pinned(services: Services) -> dict[str, tuple[int, int]]:
    return (await services.monitor.refresh()).stats.pinned_prompts or {}


@router.get("", response_model=list[SystemPrompt], summary="List system prompts",
            responses=error_responses(401, 403, 404))
async def list_prompts(admin: AdminDep, services: ServicesDep,
                       tenant: TenantFilter = None
                       ) -> list[SystemPrompt]:
    records = await run_in_threadpool(services.registry.prompts.list, tenant)
    pinned = await _pinned(services)
    return [await _prompt(services, record, pinned) for record in records]


@router.post("", response_model=SystemPrompt, status_code=status.HTTP_201_CREATED,
             summary="Add a system prompt", responses=error_responses(400, 401, 403, 404, 409))
async def add_prompt(body: PromptCreate, admin: AdminDep, services: ServicesDep) -> SystemPrompt:
    """A named system prompt of a tenant, optionally bound to one of its adapters (the engine
    shares the KV cache of a prompt per adapter). Its KV is computed now and held while it is
    registered."""
    record = await run_in_threadpool(lambda: services.registry.prompts.add(
        body.tenant, body.name, body.text, adapter=body.adapter, actor=admin.key_id))
    await warm_system_prompt(services, record)
    return await _prompt(services, record)


@router.get("/{tenant}/{name}", response_model=SystemPrompt, summary="Get a system prompt",
            responses=error_responses(401, 403, 404))
async def get_prompt(tenant: NameParam, name: NameParam, admin: AdminDep,
                     services: ServicesDep) -> SystemPrompt:
    return await _prompt(services, await run_in_threadpool(services.registry.prompts.get, tenant, name))


@router.delete("/{tenant}/{name}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response,
               summary="Delete a system prompt", responses=error_responses(401, 403, 404))
async def delete_prompt(tenant: NameParam, name: NameParam, admin: AdminDep,
                        services: ServicesDep) -> Response:
    await run_in_threadpool(lambda: services.registry.prompts.delete(tenant, name, actor=admin.key_id))
    await unpin_system_prompts(services, tenant, name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)

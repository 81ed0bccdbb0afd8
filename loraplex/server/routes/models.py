"""GET /v1/models: the base model and the caller's own adapters, nothing else."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from loraplex.registry.records import AdapterRecord
from loraplex.server.auth import TenantDep
from loraplex.server.deps import ServicesDep
from loraplex.server.generation import resolve_model
from loraplex.server.routes.docs import error_responses
from loraplex.server.schemas.openai import Model, ModelList
from loraplex.server.services import Services

router = APIRouter(prefix="/v1", tags=["OpenAI API"])
OWNER = "loraplex"


@router.get("/models", response_model=ModelList, summary="List the models you can use",
            responses=error_responses(401, 403, 503))
async def list_models(principal: TenantDep, services: ServicesDep) -> ModelList:
    """The base model, then your adapters (`parent` is the base model's id)."""
    adapters = await run_in_threadpool(services.registry.adapters.list, principal.tenant)
    return ModelList(data=[_base(services), *(_adapter(services, a) for a in adapters)])


@router.get("/models/{model}", response_model=Model, summary="Describe one model",
            responses=error_responses(401, 403, 404, 503))
async def get_model(model: str, principal: TenantDep, services: ServicesDep) -> Model:
    adapter = await resolve_model(services, principal.tenant, model)
    return _base(services) if adapter is None else _adapter(services, adapter)


def _base(services: Services) -> Model:
    return Model(id=services.config.model_id, created=int(services.started_at), owned_by=OWNER,
                 parent=None, max_model_len=services.llm.max_model_len)


def _adapter(services: Services, adapter: AdapterRecord) -> Model:
    return Model(id=adapter.name, created=int(adapter.created_at.timestamp()), owned_by=adapter.tenant,
                 parent=services.config.model_id, max_model_len=services.llm.max_model_len)

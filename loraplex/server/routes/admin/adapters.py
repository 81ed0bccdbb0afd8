"""Adapters: list, upload (multipart, streamed to the registry), get, delete."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response, status
from starlette.concurrency import run_in_threadpool

from loraplex.adapter_format import CONFIG_NAME, WEIGHTS_NAME
from loraplex.server.auth import AdminDep
from loraplex.server.deps import ServicesDep
from loraplex.server.routes.admin.params import NameParam, TenantFilter
from loraplex.server.routes.docs import error_responses
from loraplex.server.schemas.admin import NAME_PATTERN, Adapter
from loraplex.server.services import Services
from loraplex.server.uploads import CONFIG_FIELD, WEIGHTS_FIELD, receive_adapter

router = APIRouter(prefix="/adapters", tags=["Admin: adapters"])
UPLOAD_PATH = "/adapters"
UPLOAD_FORM = {
    "required": True,
    "content": {"multipart/form-data": {
        "schema": {
            "type": "object",
            "required": ["tenant", "name", CONFIG_FIELD, WEIGHTS_FIELD],
            "properties": {
                "tenant": {"type": "string", "pattern": NAME_PATTERN, "description": "Owner."},
                "name": {"type": "string", "pattern": NAME_PATTERN,
                         "description": "The adapter's name: what requests put in `model`."},
                CONFIG_FIELD: {"type": "string", "format": "binary",
                               "description": f"{CONFIG_NAME} (at most 64 KiB)."},
                WEIGHTS_FIELD: {"type": "string", "format": "binary",
                                "description": f"{WEIGHTS_NAME} (safetensors only; never pickle)."},
            },
        },
    }},
}


async def _adapters(services: Services, records: list) -> list[Adapter]:
    stats = (await services.monitor.refresh()).stats
    on_host = set(stats.adapters_on_host)
    device_bytes = stats.adapter_device_bytes or dict.fromkeys(stats.adapters_in_slots, 0)
    return [Adapter.of(record, on_host, device_bytes) for record in records]


@router.get("", response_model=list[Adapter], summary="List adapters",
            responses=error_responses(401, 403, 404))
async def list_adapters(admin: AdminDep, services: ServicesDep,
                        tenant: TenantFilter = None
                        ) -> list[Adapter]:
    await run_in_threadpool(services.usage.flush)  # requests served so far are counted
    records = await run_in_threadpool(services.registry.adapters.list, tenant)
    return await _adapters(services, list(records))


@router.post("", response_model=Adapter, status_code=status.HTTP_201_CREATED,
             summary="Upload a PEFT LoRA adapter", openapi_extra={"requestBody": UPLOAD_FORM},
             responses=error_responses(400, 401, 403, 404, 409, 413, 503))
async def upload_adapter(request: Request, admin: AdminDep, services: ServicesDep) -> Adapter:
    """A multipart form: `tenant`, `name`, `adapter_config` and `adapter_model`, best in that
    order (the weights then stream straight to storage). The adapter is validated against the
    served base model (PEFT LoRA only, rank, shapes, dtypes, finite values, safetensors header);
    any failure is a 4xx naming the problem, and then nothing is stored. Servable at once."""
    async with services.upload_slots:
        record = await receive_adapter(request, services.registry, admin.key_id)
    services.adapters.forget(record.tenant, record.name)
    return (await _adapters(services, [record]))[0]


@router.get("/{tenant}/{name}", response_model=Adapter, summary="Get an adapter",
            responses=error_responses(401, 403, 404))
async def get_adapter(tenant: NameParam, name: NameParam, admin: AdminDep,
                      services: ServicesDep) -> Adapter:
    await run_in_threadpool(services.usage.flush)
    record = await run_in_threadpool(services.registry.adapters.get, tenant, name)
    return (await _adapters(services, [record]))[0]


@router.delete("/{tenant}/{name}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response,
               summary="Delete an adapter", responses=error_responses(401, 403, 404))
async def delete_adapter(tenant: NameParam, name: NameParam, admin: AdminDep,
                         services: ServicesDep) -> Response:
    """Requests naming it are refused from now on (on other servers within a second); requests
    running with it finish."""
    await run_in_threadpool(services.registry.adapters.delete, tenant, name, actor=admin.key_id)
    services.adapters.forget(tenant, name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)

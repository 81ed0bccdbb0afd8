"""Tenants: create, list, get, change weight and limits, delete."""

from __future__ import annotations

from fastapi import APIRouter, Response, status
from starlette.concurrency import run_in_threadpool

from loraplex.registry.tenant_service import UNCHANGED
from loraplex.server.auth import AdminDep
from loraplex.server.deps import ServicesDep
from loraplex.server.routes.admin.params import NameParam
from loraplex.server.routes.docs import error_responses
from loraplex.server.schemas.admin import Tenant, TenantCreate, TenantUpdate
from loraplex.server.system_prompts import unpin_system_prompts

router = APIRouter(prefix="/tenants", tags=["Admin: tenants"])


@router.get("", response_model=list[Tenant], summary="List tenants", responses=error_responses(401, 403))
def list_tenants(admin: AdminDep, services: ServicesDep) -> list[Tenant]:
    limiter = services.limiter
    return [Tenant.of(t, limiter.in_flight(t.name)) for t in services.registry.tenants.list()]


@router.post("", response_model=Tenant, status_code=status.HTTP_201_CREATED, summary="Create a tenant",
             responses=error_responses(400, 401, 403, 409))
def create_tenant(body: TenantCreate, admin: AdminDep, services: ServicesDep) -> Tenant:
    record = services.registry.tenants.create(
        body.name, weight=body.weight, max_concurrent_requests=body.max_concurrent_requests,
        max_requests_per_minute=body.max_requests_per_minute,
        max_tokens_per_minute=body.max_tokens_per_minute, actor=admin.key_id)
    return Tenant.of(record, 0)


@router.get("/{name}", response_model=Tenant, summary="Get a tenant",
            responses=error_responses(401, 403, 404))
def get_tenant(name: NameParam, admin: AdminDep, services: ServicesDep) -> Tenant:
    return Tenant.of(services.registry.tenants.get(name), services.limiter.in_flight(name))


@router.patch("/{name}", response_model=Tenant, summary="Change a tenant's weight or limits",
              responses=error_responses(400, 401, 403, 404))
def update_tenant(name: NameParam, body: TenantUpdate, admin: AdminDep, services: ServicesDep) -> Tenant:
    """Fields left out keep their value; a limit set to null becomes unlimited. Applies to new
    requests at once."""
    given = body.model_fields_set
    changes = {field: getattr(body, field) if field in given else UNCHANGED
               for field in ("max_concurrent_requests", "max_requests_per_minute", "max_tokens_per_minute")}
    weight = body.weight if body.weight is not None else UNCHANGED
    record = services.registry.tenants.update(name, weight=weight, actor=admin.key_id, **changes)
    services.principals.forget()
    services.tenant_weights.sync(record)
    return Tenant.of(record, services.limiter.in_flight(name))


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response,
               summary="Delete a tenant with its keys, adapters, prompts and usage",
               responses=error_responses(401, 403, 404))
async def delete_tenant(name: NameParam, admin: AdminDep, services: ServicesDep) -> Response:
    await run_in_threadpool(lambda: services.registry.tenants.delete(name, actor=admin.key_id))
    services.principals.forget()
    services.adapters.forget(name)  # (the adapter manager lives on the event loop)
    await unpin_system_prompts(services, name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)

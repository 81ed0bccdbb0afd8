"""API keys: create (the secret is shown once), list, revoke."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, status

from loraplex.server.auth import AdminDep
from loraplex.server.deps import RegistryDep, ServicesDep
from loraplex.server.routes.admin.params import TenantFilter
from loraplex.server.routes.docs import error_responses
from loraplex.server.schemas.admin import ApiKey, CreatedApiKey, KeyCreate, Me

router = APIRouter(tags=["Admin: API keys"])


@router.get("/keys", response_model=list[ApiKey], summary="List API keys (never their secrets)",
            responses=error_responses(401, 403, 404))
def list_keys(admin: AdminDep, registry: RegistryDep,
              tenant: TenantFilter = None) -> list[ApiKey]:
    return [ApiKey.of(k) for k in registry.keys.list(tenant=tenant)]


@router.post("/keys", response_model=CreatedApiKey, status_code=status.HTTP_201_CREATED,
             summary="Create an API key", responses=error_responses(400, 401, 403, 404))
def create_key(body: KeyCreate, admin: AdminDep, registry: RegistryDep) -> CreatedApiKey:
    """A key for `tenant`, or an admin key (`admin: true`). `secret` is in this response only."""
    created = registry.keys.create(tenant=body.tenant, admin=body.admin, actor=admin.key_id)
    return CreatedApiKey(key=ApiKey.of(created.key), secret=created.secret)


@router.post("/keys/{key_id}/revoke", response_model=ApiKey, summary="Revoke an API key",
             responses=error_responses(401, 403, 404))
def revoke_key(key_id: Annotated[int, Path(ge=1, lt=2**31)], admin: AdminDep,
               services: ServicesDep) -> ApiKey:
    """Takes effect at once on this server, even for requests already reading the key; other
    servers on the same registry refuse it within their registry cache time (1 s by default).
    Requests already admitted finish. Revoking a revoked key changes nothing."""
    record = services.registry.keys.revoke(key_id, actor=admin.key_id)
    services.principals.forget()
    return ApiKey.of(record)


@router.get("/me", response_model=Me, summary="The key making this call",
            responses=error_responses(401, 403), tags=["Admin: API keys"])
async def whoami(admin: AdminDep) -> Me:
    return Me(key_id=admin.key_id, role=admin.role, tenant=admin.tenant)

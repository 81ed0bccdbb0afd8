"""Authentication dependencies: `Authorization: Bearer <key>`, checked against the registry
(hashes only, compared in constant time there). Tenant keys call /v1; admin keys call
/admin/api."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from loraplex.registry.records import Principal
from loraplex.registry.registry_errors import AuthenticationError
from loraplex.server.deps import get_services
from loraplex.server.http_errors import PermissionDeniedError

_bearer = HTTPBearer(auto_error=False, scheme_name="apiKey",
                     description="A loraplex API key: a tenant key for /v1, an admin key for /admin/api.")


async def get_principal(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    if credentials is None or not credentials.credentials:
        raise AuthenticationError("no API key: send the header `Authorization: Bearer <key>`")
    return await get_services(request).principals.principal_of(credentials.credentials)


async def require_tenant(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    if principal.tenant is None:
        raise PermissionDeniedError("this is an admin key; the inference API takes a tenant's key")
    return principal


async def require_admin(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    if not principal.is_admin:
        raise PermissionDeniedError("the admin API takes an admin key")
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]
TenantDep = Annotated[Principal, Depends(require_tenant)]
"""A tenant's key; `.tenant` is the tenant's name."""
AdminDep = Annotated[Principal, Depends(require_admin)]
"""An admin key; `.key_id` is recorded as the actor in the audit log."""

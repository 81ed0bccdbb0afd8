"""FastAPI dependencies for the per-app services (`Annotated` aliases). The services exist
while the app's lifespan runs; before and after, routes answer 503."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from loraplex.registry import Registry
from loraplex.server.http_errors import ServiceUnavailableError
from loraplex.server.services import Services


def get_services(request: Request) -> Services:
    services = getattr(request.app.state, "services", None)
    if services is None:
        raise ServiceUnavailableError("the server is starting or stopping", retry_after_s=1)
    return services


def get_registry(request: Request) -> Registry:
    return get_services(request).registry


ServicesDep = Annotated[Services, Depends(get_services)]
RegistryDep = Annotated[Registry, Depends(get_registry)]

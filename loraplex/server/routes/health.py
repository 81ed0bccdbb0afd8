"""Liveness, readiness and Prometheus metrics (no key needed: keep them off public networks or
behind a proxy)."""

from __future__ import annotations

import contextlib
from typing import Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from loraplex.server.deps import ServicesDep
from loraplex.server.http_errors import error_body
from loraplex.server.routes.docs import error_responses

router = APIRouter(tags=["Operations"])
LIVENESS_PATH = "/health"
READINESS_PATH = "/ready"
METRICS_PATH = "/metrics"


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    status: Literal["ready"]
    model: str


@router.get(LIVENESS_PATH, response_model=Health, summary="Liveness: the process answers")
async def health() -> Health:
    """200 while the process serves HTTP, draining included (restart it only when this fails;
    take it out of rotation when /ready fails)."""
    return Health(status="ok")


@router.get(READINESS_PATH, response_model=Readiness, summary="Readiness: engine and registry usable",
            responses=error_responses(503))
async def ready(request: Request) -> Readiness | JSONResponse:
    """200 when the engine thread runs and the registry database answers; else 503."""
    services = getattr(request.app.state, "services", None)
    problem = None
    if services is None or services.is_stopping:
        problem = "the server is starting or stopping"
    elif services.is_draining:
        problem = "the server is draining (shutting down): it admits no new requests"
    elif not services.engine.is_alive:
        problem = "the engine has stopped"
    else:
        try:
            await run_in_threadpool(services.registry.models.get)
        except Exception as exc:  # any database failure means not ready
            problem = f"the registry database is unavailable ({type(exc).__name__})"
    if problem is not None:
        return JSONResponse(error_body(problem, 503, "not_ready"), 503, {"Retry-After": "1"})
    return Readiness(status="ready", model=services.config.model_id)


@router.get(METRICS_PATH, summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}})
async def metrics(services: ServicesDep) -> Response:
    with contextlib.suppress(Exception):  # a dead engine: the last sample is shown
        await services.monitor.refresh()
    return Response(services.metrics.render(), media_type=CONTENT_TYPE_LATEST)

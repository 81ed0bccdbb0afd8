"""The admin REST API under /admin/api (admin keys only): tenants, keys, adapters, system
prompts, documents, usage, engine state and the audit log. The admin web UI is written against it."""

from __future__ import annotations

from fastapi import APIRouter

from loraplex.server.routes.admin import adapters, documents, engine, keys, prompts, tenants, usage

PREFIX = "/admin/api"
UPLOAD_PATH = PREFIX + adapters.UPLOAD_PATH


def make_router() -> APIRouter:
    router = APIRouter(prefix=PREFIX)
    for module in (tenants, keys, adapters, prompts, documents, usage, engine):
        router.include_router(module.router)
    return router

"""The FastAPI app factory. Nothing is created at import time: `create_app` builds an app whose
lifespan starts the engine thread and the services, and stops them at shutdown."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from loraplex import __version__
from loraplex.engine.core_client import EngineCoreClient, EngineView
from loraplex.engine.llm_engine import LLMEngine
from loraplex.registry import Registry
from loraplex.server.adapter_names import AdapterNames
from loraplex.server.api_docs import install_api_docs
from loraplex.server.codec import max_request_body_bytes
from loraplex.server.http_errors import install_error_handlers
from loraplex.server.middleware import BodyLimit, RequestContextMiddleware
from loraplex.server.routes import chat, completions, health, models
from loraplex.server.routes.admin import UPLOAD_PATH, make_router
from loraplex.server.server_config import ServerConfig
from loraplex.server.services import Services, max_prompt_tokens
from loraplex.server.system_prompts import warm_system_prompts

logger = logging.getLogger(__name__)

DESCRIPTION = """\
An OpenAI-compatible API (`/v1`) serving one base model and each tenant's LoRA adapters, and the
admin API (`/admin/api`) that manages tenants, keys, adapters, system prompts and usage.

Authenticate with `Authorization: Bearer <key>`: a tenant's key for `/v1`, an admin key for
`/admin/api`. Errors are OpenAI error bodies: `{"error": {"message", "type", "param", "code"}}`.
"""
TAGS = [
    {"name": "OpenAI API", "description": "Completions, chat and models, as OpenAI's clients expect."},
    {"name": "Admin: tenants"}, {"name": "Admin: API keys"}, {"name": "Admin: adapters"},
    {"name": "Admin: system prompts"}, {"name": "Admin: usage and audit"}, {"name": "Admin: engine"},
    {"name": "Operations", "description": "Liveness, readiness and metrics (no key)."},
]


def create_app(config: ServerConfig, registry: Registry, engine: LLMEngine | EngineCoreClient,
               adapters: AdapterNames | None = None) -> FastAPI:
    """An app serving `engine` with `registry`. The caller owns both: the app starts the
    engine's thread for its lifespan but neither closes the registry nor frees the model. An
    EngineCoreClient (the engine in a process of its own) is stopped when the lifespan ends.
    `adapters`: where adapter names resolve and adapters load from (default: the registry)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = Services.start(config, registry, engine, adapters)
        app.state.services = services
        try:
            await warm_system_prompts(services)
            yield
        finally:
            app.state.services = None
            await services.stop()
            if isinstance(engine, LLMEngine):
                for key in engine.pinned_prompts():  # the engine thread has stopped: this app's pins go
                    engine.unpin_prompt(key)

    app = FastAPI(title="loraplex", version=__version__, description=DESCRIPTION, openapi_tags=TAGS,
                  lifespan=lifespan, docs_url=None, redoc_url=None)
    install_api_docs(app)
    app.state.services = None
    install_error_handlers(app)
    app.add_middleware(RequestContextMiddleware, max_body_bytes=config.max_body_bytes,
                       path_limits=_body_limits(config, engine.view if isinstance(engine, EngineCoreClient)
                                                else engine))
    for module in (completions, chat, models, health):
        app.include_router(module.router)
    app.include_router(make_router())
    _mount_admin_ui(app, config)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _body_limits(config: ServerConfig, engine: LLMEngine | EngineView) -> dict[str, BodyLimit]:
    """Uploads may be large; a completion's body need not be larger than its longest prompt
    that fits (refused before it is read, let alone parsed or tokenized)."""
    num_tokens = max_prompt_tokens(config, engine)
    inference = BodyLimit(min(config.max_body_bytes, max_request_body_bytes(engine.tokenizer, num_tokens)),
                          f": no request whose prompt fits this model ({num_tokens} tokens at most) "
                          f"needs more")
    generation_paths = {route.path for router in (completions.router, chat.router) for route in router.routes}
    return {UPLOAD_PATH: BodyLimit(config.max_upload_bytes)} | dict.fromkeys(generation_paths, inference)


def _mount_admin_ui(app: FastAPI, config: ServerConfig) -> None:
    folder = config.admin_ui_dir
    if folder is not None and (folder / "index.html").is_file():
        app.mount("/admin", StaticFiles(directory=folder, html=True), name="admin-ui")
        logger.info("admin UI served at /admin from %s", folder)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document with its 422 responses turned into 400s (as validation errors are
    answered here)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, description=app.description,
                             routes=app.routes, tags=app.openapi_tags)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                responses = operation.get("responses", {})
                if responses.pop("422", None) is not None:
                    responses.setdefault("400", {
                        "description": "Invalid request: the error names the parameter (`param`).",
                        "content": {"application/json": {"schema": {
                            "$ref": "#/components/schemas/ErrorResponse"}}}})
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema

"""Errors as the API returns them: every failure becomes an OpenAI error body
`{"error": {"message", "type", "param", "code"}}` with a string `code`, an HTTP status chosen by
the exception's class, and `Retry-After` / `x-should-retry` where a client should (or should
not) try again. Internal errors are logged under the request id and answered generically."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException

from loraplex.engine.async_engine import EngineDeadError
from loraplex.errors import (
    AdapterError,
    InvalidRequestError,
    LoraplexError,
    ModelLoadError,
    UnknownAdapterError,
)
from loraplex.registry.registry_errors import (
    AuthenticationError,
    BaseModelUnknownError,
    ConflictError,
    InvalidInputError,
    NotFoundError,
    RegistryError,
    StorageFullError,
)
from loraplex.server.request_id import REQUEST_ID_HEADER, request_id_of
from loraplex.server.schemas.client_body import INVALID_UNICODE, NESTED_TOO_DEEP

logger = logging.getLogger(__name__)


class PermissionDeniedError(LoraplexError):
    """A valid key that may not use this route (a tenant key on the admin API)."""

    code = "permission_denied"


class RateLimitError(LoraplexError):
    """A tenant is over one of its limits. `headers` carry Retry-After and x-ratelimit-*."""

    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, headers: Mapping[str, str], can_retry: bool = True) -> None:
        super().__init__(message)
        self.headers = dict(headers) | ({} if can_retry else {"x-should-retry": "false"})


class ServiceUnavailableError(LoraplexError):
    """The server cannot take the request now (full, not ready, shutting down)."""

    code = "service_unavailable"

    def __init__(self, message: str, *, retry_after_s: int, code: str | None = None) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": str(retry_after_s)}
        if code is not None:
            self.code = code


_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (AuthenticationError, 401),
    (PermissionDeniedError, 403),
    (UnknownAdapterError, 404),
    (NotFoundError, 404),
    (ConflictError, 409),
    (RateLimitError, 429),
    (AdapterError, 400),
    (InvalidInputError, 400),
    (InvalidRequestError, 400),
    (BaseModelUnknownError, 503),
    (RegistryError, 503),
    (ServiceUnavailableError, 503),
    (StorageFullError, 507),
    (ModelLoadError, 500),
)
_TYPES = {401: "invalid_request_error", 403: "permission_error", 429: "rate_limit_error"}


def status_of(exc: BaseException) -> int:
    return next((status for cls, status in _STATUS if isinstance(exc, cls)), 500)


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(message: str, status: int, code: str | None, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error body. Text from a request that is quoted in it can hold lone surrogates,
    which no JSON encoder writes as UTF-8: they are escaped (`\\ud800`)."""
    return {"error": {"message": _printable(message), "type": error_type(status),
                      "param": None if param is None else _printable(param), "code": code}}


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(exc: LoraplexError) -> JSONResponse:
    status = status_of(exc)
    return JSONResponse(error_body(exc.message, status, exc.code, exc.param), status,
                        dict(getattr(exc, "headers", {})))


def stream_error(exc: BaseException, request_id: str) -> dict[str, Any]:
    """The body of a `data: {"error": ...}` event for a failure after streaming began."""
    if isinstance(exc, LoraplexError):
        return error_body(exc.message, status_of(exc), exc.code, exc.param)
    if isinstance(exc, EngineDeadError):
        return error_body("the engine has stopped", 503, "engine_unavailable")
    logger.error("request %s failed while streaming", request_id, exc_info=exc)
    return error_body(f"internal error (request id {request_id})", 500, "internal_error")


def install_error_handlers(app: FastAPI) -> None:
    handlers: dict[type[Exception], Any] = {
        LoraplexError: _loraplex_error, EngineDeadError: _engine_dead,
        RequestValidationError: _validation_error, HTTPException: _http_error,
        OperationalError: _database_unavailable, Exception: _internal_error,
    }
    for cls, handler in handlers.items():
        app.add_exception_handler(cls, handler)


async def _loraplex_error(request: Request, exc: LoraplexError) -> JSONResponse:
    if status_of(exc) >= 500:
        logger.error("request %s failed: %s", request_id_of(request.scope), exc.message)
    return error_response(exc)


async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
    return JSONResponse(error_body("the engine has stopped; the server must be restarted", 503,
                                   "engine_unavailable"), 503, {"Retry-After": "30"})


async def _database_unavailable(request: Request, exc: OperationalError) -> JSONResponse:
    logger.error("request %s: the registry database failed: %s", request_id_of(request.scope),
                 str(exc.orig or exc).strip().splitlines()[0])
    return JSONResponse(error_body("the registry database is unavailable; retry shortly", 503,
                                   "registry_unavailable"), 503, {"Retry-After": "1"})


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    codes = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
    return JSONResponse(error_body(str(exc.detail), exc.status_code, codes.get(exc.status_code)),
                        exc.status_code, exc.headers)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    request_id = request_id_of(request.scope)
    logger.error("request %s failed", request_id, exc_info=exc)
    return JSONResponse(error_body(f"internal error (request id {request_id})", 500, "internal_error"),
                        500, {REQUEST_ID_HEADER: request_id, "x-should-retry": "false"})


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 becomes a 400 naming the offending field, as OpenAI answers."""
    errors = exc.errors() or [{"loc": (), "msg": "invalid request", "type": "value_error"}]
    # A union (e.g. `prompt`: text or token ids) reports one error per form; the most telling
    # is one where the type matched and a constraint failed.
    first = next((e for e in errors if not str(e.get("type", "")).endswith(("_type", "_parsing"))),
                 errors[0])
    param = _param(first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        message, code = f"Unrecognized request argument supplied: {param}", "unknown_parameter"
    elif kind == "missing":
        message, code = f"Missing required parameter: {param}", "missing_required_parameter"
    elif kind == "json_invalid":
        message, code, param = "The request body is not valid JSON", "invalid_json", None
    elif kind in (INVALID_UNICODE, NESTED_TOO_DEEP):  # the whole body was checked: ctx has the path
        param = _param((*first.get("loc", ()), *first["ctx"]["path"]))
        message, code = first.get("msg", "invalid value"), kind
    else:
        message = first.get("msg", "invalid value")
        message, code = (f"{param}: {message}" if param else message), "invalid_value"
    return JSONResponse(error_body(message, 400, code, param), 400)


_UNION_TAG = re.compile(r"^(str|int|float|bool|bytes|none|dict|list|tuple|set)$|[\[\-]")


def _param(location: tuple) -> str | None:
    """`messages.0.role` from pydantic's location, without its union tags (`list[int]`)."""
    parts = []
    for part in location:
        if part in ("body", "query", "path", "header") and not parts:
            continue
        if isinstance(part, str) and _UNION_TAG.search(part):
            break
        parts.append(str(part))
    return ".".join(parts) or None

"""Every request gets an id: made by the middleware, returned as `x-request-id`, used as the
engine request id and in log lines."""

from __future__ import annotations

import secrets

from starlette.types import Scope

REQUEST_ID_HEADER = "x-request-id"


def new_request_id() -> str:
    return secrets.token_hex(12)


def request_id_of(scope: Scope) -> str:
    """The id the middleware gave this request (a fresh one outside the middleware)."""
    state = scope.setdefault("state", {})
    if "request_id" not in state:
        state["request_id"] = new_request_id()
    return state["request_id"]

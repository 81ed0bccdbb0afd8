"""What the OpenAPI document says about error responses."""

from __future__ import annotations

from typing import Any

from loraplex.server.schemas.openai import ErrorResponse

_DESCRIPTIONS = {
    400: "Invalid request: the error names the parameter (`param`).",
    401: "Missing, unknown or revoked API key (`invalid_api_key`).",
    403: "The key may not use this route (a tenant key on the admin API, or the reverse).",
    404: "Not found (`model_not_found` for a model that is not yours or does not exist).",
    409: "Conflicts with what exists (a duplicate name).",
    413: "The request body is too large.",
    429: "Over the tenant's limits; see Retry-After and x-ratelimit-* headers.",
    503: "The server is full, starting or stopping; see Retry-After.",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: OpenAI-style error bodies for these statuses."""
    return {status: {"model": ErrorResponse, "description": _DESCRIPTIONS[status]}
            for status in statuses}


INFERENCE_ERRORS = error_responses(400, 401, 403, 404, 413, 429, 503)
ADMIN_ERRORS = (401, 403)

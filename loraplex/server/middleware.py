"""The one middleware (pure ASGI, so streaming and disconnect detection are untouched): a
request id on every response, and a cap on the request body (413 past it, before the body is
read when its length is declared), set per path: larger for adapter uploads, and for
completions no more than a prompt that fits the context can need."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.server.http_errors import error_body
from loraplex.server.request_id import REQUEST_ID_HEADER, request_id_of


@dataclass(frozen=True)
class BodyLimit:
    max_bytes: int
    reason: str = ""
    """Why, appended to the 413's message."""

    def message(self) -> str:
        return f"the request body is larger than {self.max_bytes} bytes{self.reason}"


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int, path_limits: Mapping[str, BodyLimit]) -> None:
        self.app = app
        self.default_limit = BodyLimit(max_body_bytes)
        self.path_limits = dict(path_limits)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope)
        header = (REQUEST_ID_HEADER.encode(), request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        limit = self.path_limits.get(scope["path"], self.default_limit)
        declared = _content_length(scope)
        if declared is not None and declared > limit.max_bytes:
            await _send_too_large(send_with_id, limit.message())
            return
        received = 0

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit.max_bytes:
                    raise HTTPException(413, limit.message())
            return message

        await self.app(scope, receive_limited, send_with_id)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_too_large(send: Send, message: str) -> None:
    body = json.dumps(error_body(message, 413, "request_too_large")).encode()
    await send({"type": "http.response.start", "status": 413, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})

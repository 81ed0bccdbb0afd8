"""The one middleware (pure ASGI, so streaming and disconnect detection are untouched): a
request id on every response, and a cap on the request body (413 past it), larger for adapter
uploads."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.server.http_errors import error_body
from loraplex.server.request_id import REQUEST_ID_HEADER, request_id_of


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int, max_upload_bytes: int,
                 upload_paths: tuple[str, ...]) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_upload_bytes = max_upload_bytes
        self.upload_paths = upload_paths

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

        limit = self.max_upload_bytes if scope["path"] in self.upload_paths else self.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _send_too_large(send_with_id, limit)
            return
        received = 0

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, f"the request body is larger than {limit} bytes")
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


async def _send_too_large(send: Send, limit: int) -> None:
    body = json.dumps(error_body(f"the request body is larger than {limit} bytes", 413,
                                 "request_too_large")).encode()
    await send({"type": "http.response.start", "status": 413, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})

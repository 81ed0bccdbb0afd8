"""Server-sent events and client disconnects. A request's engine work stops as soon as its
client goes away: while it waits for its first token (`until_disconnect` races the wait against
the ASGI disconnect message) and while it streams (`EventStreamResponse` listens for the
disconnect whatever the ASGI version, and always closes the engine stream at the end)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = "data: [DONE]\n\n"
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
"""Stateless; built once (json.dumps with options builds an encoder per call)."""
_OMIT: Any = object()


def sse(data: Any) -> str:
    """One event: `data: <json>` and a blank line."""
    return f"data: {_ENCODER.encode(data)}\n\n"


class ChunkEvents:
    """The events of one streamed answer, `data: {<fixed fields>, "choices": [...]}` with
    `"usage"` after them if given: the fields that never change (id, model, ...) are encoded
    once, not at every token. The text is what `sse` makes of the whole object."""

    def __init__(self, fixed: dict[str, Any]) -> None:
        self._head = f'data: {_ENCODER.encode(fixed)[:-1]},"choices":'

    def event(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = _OMIT) -> str:
        if usage is _OMIT:
            tail = "}\n\n"
        elif usage is None:
            tail = ',"usage":null}\n\n'
        else:  # counts under plain keys: as the encoder writes them, at a fifth of its cost
            counts = ",".join([f'"{key}":{int(count)}' for key, count in usage.items()])
            tail = f',"usage":{{{counts}}}}}\n\n'
        return f"{self._head}{_ENCODER.encode(choices)}{tail}"


class ClientDisconnected(Exception):
    """The client left before the response began."""


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, cancelling it (and raising ClientDisconnected) if the client
    disconnects first. The request body must have been read already."""
    work = asyncio.ensure_future(awaitable)
    listener = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({work, listener}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            raise ClientDisconnected
        return work.result()
    finally:
        listener.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that stops (and cancels its producer) when the client
    disconnects, and always runs `on_close` (which aborts the engine request if it is still
    going)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await _wait_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()

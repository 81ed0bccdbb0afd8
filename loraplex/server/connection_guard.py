"""Clients that hold the server without using it, bounded where uvicorn leaves them unbounded:
its HTTP protocol waits forever for a request's headers or body (slowloris), for a client that
does not read its response (a stalled write holds the request, its admission and its engine
request), and accepts connections until the process runs out of file descriptors.

`guarded_protocol(config)` is uvicorn's httptools protocol with three limits:
- more than `max_connections` open connections: each new one is answered 503 with Retry-After
  (code `too_many_connections`) once its request's headers have arrived, and closed;
- a request's headers must arrive within `client_timeout_s` of the connection's start (or the
  end of the previous response on a kept-alive connection), and its body must keep arriving: at
  least `min_body_bytes_per_s` on average after the first `client_timeout_s` (waiting on the
  server, which pauses reading while the app has not taken the body, does not count); else 408
  and the connection is closed;
- a response whose writes have stalled (the client does not read, the socket's buffer is full)
  for `client_timeout_s` is cut: the connection is aborted, which the app sees as a disconnect
  (a generation is aborted in the engine and its admission released).

A connection's memory is then bounded by what uvicorn buffers for it (64 KiB of request body
before it pauses reading; 64 KiB of response in the transport, and one message beyond) and by
its socket's send buffer (SEND_BUFFER_BYTES, which the kernel doubles), and the open connections
by `max_connections` plus those waiting for their 503."""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import socket
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from loraplex.server.http_errors import error_body
from loraplex.server.server_config import ServerConfig

RESERVED_FDS = 256
SEND_BUFFER_BYTES = 128 << 10
"""Each connection's socket send buffer (the kernel doubles it). Left to itself, Linux grows it
up to net.ipv4.tcp_wmem's maximum (4 MiB by default) for a client that does not read: 3 MB a
connection on loopback, and the stall that `client_timeout_s` catches comes only after it."""
"""File descriptors kept for everything but client connections (database, blobs, logs, model)."""


def guarded_protocol(config: ServerConfig) -> type[HttpToolsProtocol]:
    """uvicorn's `http` protocol class, with the config's connection limits."""
    return type("GuardedHttpToolsProtocol", (_Guard, HttpToolsProtocol), {"limits": config})


def raise_fd_limit(max_connections: int) -> int:
    """Raise this process's soft limit on open files towards what `max_connections` needs
    (within the hard limit); returns the connections it allows (`max_connections`, or fewer
    where the hard limit is lower)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + RESERVED_FDS
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)
    if wanted > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        soft = wanted
    return max(1, min(max_connections, soft - RESERVED_FDS))


def _json_response(status: int, reason: str, message: str, code: str, headers: dict[str, str]) -> bytes:
    body = json.dumps(error_body(message, status, code)).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class _Guard:
    """The limits, over uvicorn's HttpToolsProtocol (its callbacks are extended, not replaced)."""

    limits: ServerConfig
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    connections: set[Any]
    flow: Any
    cycle: Any
    app: Any

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._is_refused = len(self.connections) > self.limits.max_connections
        self._deadline: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._body_started: float | None = None
        self._body_bytes = 0
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        super().connection_lost(exc)  # type: ignore[misc]

    # Headers and bodies ---------------------------------------------------------------------
    def _await_headers(self) -> None:
        self._cancel()
        self._has_begun = False
        self._deadline = self.loop.call_later(self.limits.client_timeout_s, self._too_slow)

    def on_message_begin(self) -> None:
        self._has_begun = True
        super().on_message_begin()  # type: ignore[misc]

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def on_headers_complete(self) -> None:
        self._cancel()
        if self._is_refused:
            app, self.app = self.app, self._refuse
            try:
                super().on_headers_complete()  # type: ignore[misc]
            finally:
                self.app = app
        else:
            super().on_headers_complete()  # type: ignore[misc]
        self._body_started, self._body_bytes = time.monotonic(), 0
        self._deadline = self.loop.call_later(self.limits.client_timeout_s, self._check_body)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)  # type: ignore[misc]

    def on_message_complete(self) -> None:
        self._cancel()
        self._body_started = None
        super().on_message_complete()  # type: ignore[misc]

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        # A pipelined request already in (its cycle is the latest) is not waited for.
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._await_headers()

    def _check_body(self) -> None:
        """Past the grace, the body must have come at min_body_bytes_per_s on average."""
        self._deadline = None
        if self._body_started is None or self.transport.is_closing():
            return
        if self.flow.read_paused:  # the server's turn: the app has not taken what came
            self._body_started = time.monotonic() - self.limits.client_timeout_s
            self._body_bytes = 0
            self._deadline = self.loop.call_later(self.limits.client_timeout_s, self._check_body)
            return
        limits = self.limits
        elapsed = time.monotonic() - self._body_started
        due = (elapsed - limits.client_timeout_s) * limits.min_body_bytes_per_s
        if self._body_bytes < due:
            self._too_slow()
            return
        # When will what has come no longer be enough?
        at = limits.client_timeout_s + self._body_bytes / limits.min_body_bytes_per_s
        self._deadline = self.loop.call_later(max(0.1, at - elapsed), self._check_body)

    def _too_slow(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if not self._has_begun:  # an idle kept-alive connection: closed without an answer
            self.transport.close()
            return
        cycle = self.cycle if self.cycle is not None and not self.cycle.response_complete else None
        if cycle is not None:
            cycle.disconnected = True  # the app (if it runs) sees a disconnect, sends nothing
            cycle.message_event.set()
            if cycle.response_started:  # (a response begun before its request's body ended)
                self.transport.abort()
                return
        self.transport.write(_json_response(
            408, "Request Timeout", f"the request did not arrive within {self.limits.client_timeout_s:g} s "
            f"(headers), or its body came slower than {self.limits.min_body_bytes_per_s} bytes/s",
            "request_timeout", {}))
        self.transport.close()

    # Responses ------------------------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        if self._stall is None:
            self._stall = self.loop.call_later(self.limits.client_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()  # type: ignore[misc]
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        """The client has read nothing of its response for client_timeout_s: cut it off."""
        self._stall = None
        if not self.transport.is_closing():
            self.transport.abort()

    async def _refuse(self, scope: Any, receive: Any, send: Any) -> None:
        """Past max_connections: 503 with Retry-After (the body read first, so that closing the
        socket does not reset the answer away)."""
        message = await receive()
        while message.get("more_body"):
            message = await receive()
        limits = self.limits
        body = json.dumps(error_body(
            f"the server has {limits.max_connections} connections open, its limit; retry shortly",
            503, "too_many_connections")).encode()
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"connection", b"close"),
            (b"retry-after", str(limits.retry_after_s).encode())]})
        await send({"type": "http.response.body", "body": body})

"""The connection limits of `loraplex serve`'s HTTP protocol (loraplex/server/connection_guard.py)
in detail, on a trivial app and a half-second client timeout: what tests/server/test_overload.py
shows at scale, and what it must not do to well-behaved clients (pipelined requests, a response
that takes longer than the timeout, an idle kept-alive connection)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from urllib.parse import parse_qs

import pytest

from loraplex.server import ServerConfig
from loraplex.server.connection_guard import guarded_protocol
from tests.server.server_support import run_uvicorn

TIMEOUT_S = 0.5
MAX_CONNECTIONS = 2


async def _app(scope, receive, send) -> None:  # noqa: ANN001 (ASGI)
    """200 `ok` after `?sleep=` seconds, once the body is in."""
    if scope["type"] != "http":
        return
    message = await receive()
    while message.get("more_body"):
        message = await receive()
    await asyncio.sleep(float(parse_qs(scope["query_string"].decode()).get("sleep", ["0"])[0]))
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def address() -> Iterator[tuple[str, int]]:
    config = ServerConfig(model_id="guarded", client_timeout_s=TIMEOUT_S, max_connections=MAX_CONNECTIONS)
    with run_uvicorn(_app, http=guarded_protocol(config)) as url:
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port)


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _get(path: str, close: bool = False) -> bytes:
    head = f"GET {path} HTTP/1.1\r\nHost: x\r\n" + ("Connection: close\r\n" if close else "")
    return (head + "\r\n").encode()


def test_slow_headers_get_408_and_a_slow_body_too(address: tuple[str, int]) -> None:
    with socket.create_connection(address) as slow:
        slow.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        assert _read_all(slow).startswith(b"HTTP/1.1 408")
        assert time.monotonic() - started < TIMEOUT_S + 5
    with socket.create_connection(address) as slow:
        slow.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
        answer = _read_all(slow)
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer


def test_past_max_connections_a_request_gets_503_with_retry_after(address: tuple[str, int]) -> None:
    held = [socket.create_connection(address) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.1)  # accepted
        with socket.create_connection(address) as extra:
            extra.sendall(_get("/"))
            answer = _read_all(extra)
        assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer.lower()
        assert b"too_many_connections" in answer
    finally:
        for sock in held:
            sock.close()


def test_well_behaved_clients_are_not_cut(address: tuple[str, int]) -> None:
    """A response slower than the timeout, pipelined requests, and an idle kept-alive connection
    (closed after the timeout without an answer that a client would take for the next one's)."""
    with socket.create_connection(address) as client:
        client.sendall(_get(f"/?sleep={2 * TIMEOUT_S}") + _get(f"/?sleep={2 * TIMEOUT_S}", close=True))
        assert _read_all(client).count(b"HTTP/1.1 200") == 2
    with socket.create_connection(address) as client:
        client.sendall(_get("/"))
        client.settimeout(10)
        assert client.recv(65536).startswith(b"HTTP/1.1 200")
        time.sleep(2 * TIMEOUT_S)
        assert _read_all(client) == b""

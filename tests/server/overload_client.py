"""The attacking clients of tests/server/test_overload.py, run in a process of their own
(spawned: it imports only the standard library) at the lowest CPU priority on one core: they
stand for clients on other machines. Raw sockets on one asyncio loop, so that thousands of them
cost little."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from typing import Any

TRICKLE_INTERVAL_S = 1.0
MAX_CONNECTING = 256
"""Connections being opened at once (more would overflow the server's accept queue: its SYNs
are then retried a second later)."""


async def _answer(reader: asyncio.StreamReader) -> tuple[str, dict[str, str]]:
    """The status of the server's answer (or `closed` / `reset` when there is none) and its
    headers."""
    try:
        line = await reader.readline()
    except (ConnectionError, OSError):
        return "reset", {}
    if not line:
        return "closed", {}
    headers = {}
    while True:
        try:
            header = await reader.readline()
        except (ConnectionError, OSError):
            break
        if header in (b"\r\n", b""):
            break
        name, _, value = header.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return line.split()[1].decode(), headers


async def _trickle(host: str, port: int, head: bytes, drip: bytes, gate: asyncio.Semaphore,
                   opened: list[int]) -> tuple[str, float]:
    """Send `head`, then `drip` every TRICKLE_INTERVAL_S, until the server answers or closes;
    returns the answer and how long the connection was held after it opened. `opened` counts
    the connections open [0] and ended [1]."""
    async with gate:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(head)
        opened[0] += 1
    started = time.monotonic()
    answer = asyncio.ensure_future(_answer(reader))
    try:
        while not answer.done():
            await asyncio.wait([answer], timeout=TRICKLE_INTERVAL_S)
            if not answer.done():
                try:
                    writer.write(drip)
                    await writer.drain()
                except (ConnectionError, OSError):
                    break
        status = (await answer)[0]
    finally:
        writer.close()
        opened[1] += 1
    return status, time.monotonic() - started


async def _eager(host: str, port: int, request: bytes) -> tuple[str, str | None]:
    """A complete request: (its answer, its Retry-After)."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return "refused", None
    writer.write(request)
    status, headers = await _answer(reader)
    writer.close()
    return status, headers.get("retry-after")


async def _attack(host: str, port: int, plan: dict[str, Any], established: Any, go_eager: Any,
                  results: Any) -> None:
    gate = asyncio.Semaphore(MAX_CONNECTING)
    opened = [0, 0]
    slow_head = b"GET /health HTTP/1.1\r\nHost: x\r\n"
    body_head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + plan["key"].encode() + b"\r\nContent-Length: 100000\r\n\r\n{")
    held = [asyncio.ensure_future(_trickle(host, port, body_head, b" ", gate, opened))
            for _ in range(plan["num_slow_bodies"])]
    held += [asyncio.ensure_future(_trickle(host, port, slow_head, b"X-a: b\r\n", gate, opened))
             for _ in range(plan["num_slow_headers"])]
    total = len(held)
    while opened[0] < total:
        await asyncio.sleep(0.05)
    established.set()
    while not go_eager.is_set():
        await asyncio.sleep(0.05)
    eager = await asyncio.gather(*(_eager(host, port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                                   for _ in range(plan["num_eager"])))
    held_at_eager = opened[0] - opened[1]
    done = await asyncio.gather(*held)
    num_bodies = plan["num_slow_bodies"]
    results.put({
        "slow_bodies": dict(Counter(status for status, _ in done[:num_bodies])),
        "slow_headers": dict(Counter(status for status, _ in done[num_bodies:])),
        "max_held_s": max(seconds for _, seconds in done),
        "eager": dict(Counter(status for status, _ in eager)),
        "eager_retry_after": sorted({retry for _, retry in eager if retry is not None}),
        "held_at_eager": held_at_eager,
    })


def attack(host: str, port: int, plan: dict[str, Any], established: Any, go_eager: Any,
           results: Any) -> None:
    """Open plan["num_slow_bodies"] connections that trickle a request body (one byte a second)
    and plan["num_slow_headers"] that trickle headers (one line a second), all at once; set
    `established` once all are open; once `go_eager` is set, send plan["num_eager"] complete
    requests on new connections; then wait until the server has closed every held connection,
    and put the counts of the answers on `results`."""
    os.nice(19)
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    asyncio.run(_attack(host, port, plan, established, go_eager, results))

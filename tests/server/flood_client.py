"""The flooding tenant of tests/server/test_flood.py, run in a process of its own (spawned: it
imports only httpx, so it starts fast). Its clients post one body over and over while
`flooding` is set, and count the answers."""

from __future__ import annotations

import os
import threading
from collections import Counter
from typing import Any

import httpx


def flood(url: str, key: str, body: bytes, num_clients: int, pause_s: float, flooding: Any, stop: Any,
          num_sent: Any, num_pending: Any, answers: Any) -> None:
    """`num_clients` threads post `body` to /v1/completions, each waiting `pause_s` after
    each answer, while `flooding` is set, until `stop` is; `num_sent` counts the requests
    answered, `num_pending` those under way. At the end the count of each answer (a status, or
    `closed` when the server closed the connection before answering) goes on the `answers`
    queue. The process keeps to one core at the lowest CPU priority: it stands for clients on
    other machines, whose own work the server would not feel."""
    os.nice(19)  # its own CPU use is no part of the server's: the lowest priority
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    statuses: Counter = Counter()
    lock = threading.Lock()

    def post_until_stopped() -> None:
        headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
        with httpx.Client(base_url=url, timeout=120, headers=headers) as http:
            while not stop.is_set():
                if not flooding.wait(0.05):
                    continue
                with num_pending.get_lock():
                    num_pending.value += 1
                try:
                    status: int | str = http.post("/v1/completions", content=body).status_code
                except httpx.TransportError:
                    status = "closed"
                with lock:
                    statuses[status] += 1
                with num_pending.get_lock():
                    num_pending.value -= 1
                with num_sent.get_lock():
                    num_sent.value += 1
                stop.wait(pause_s)

    threads = [threading.Thread(target=post_until_stopped) for _ in range(num_clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    answers.put(dict(statuses))

"""Usage accounting off the request path: the requests that finish together are written as one
registry write per tenant and adapter, and a flush does not wait for the gathering window."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from loraplex.server.usage_recorder import UsageRecorder


class _Usage:
    def __init__(self) -> None:
        self.writes: list[tuple] = []
        self.lock = threading.Lock()

    def record(self, tenant: str, adapter: str | None, *, prompt_tokens: int, completion_tokens: int,
               num_requests: int, at, write_id: str) -> None:
        with self.lock:
            self.writes.append((tenant, adapter, prompt_tokens, completion_tokens, num_requests))


def test_a_burst_of_finished_requests_is_one_write_per_tenant_and_adapter() -> None:
    usage = _Usage()
    recorder = UsageRecorder(SimpleNamespace(usage=usage), batch_window_s=0.5)  # type: ignore[arg-type]
    for i in range(100):
        recorder.record("acme" if i % 2 else "globex", "style" if i % 4 == 1 else None, 10, 1)
    time.sleep(0.05)  # within the window: nothing written yet
    assert usage.writes == []
    assert recorder.flush(5)
    assert sorted(usage.writes, key=str) == [("acme", "style", 250, 25, 25), ("acme", None, 250, 25, 25),
                                             ("globex", None, 500, 50, 50)]
    recorder.close()


def test_a_flush_does_not_wait_for_the_window() -> None:
    usage = _Usage()
    recorder = UsageRecorder(SimpleNamespace(usage=usage), batch_window_s=30)  # type: ignore[arg-type]
    recorder.record("acme", None, 3, 4)
    started = time.monotonic()
    assert recorder.flush(10)
    assert time.monotonic() - started < 2
    assert usage.writes == [("acme", None, 3, 4, 1)]
    recorder.record("acme", None, 1, 1)
    started = time.monotonic()
    recorder.close(10)  # close writes what is left, without the window either
    assert time.monotonic() - started < 2
    assert usage.writes[-1] == ("acme", None, 1, 1, 1)

"""Usage accounting off the request path: the requests that finish together are written as one
registry transaction, one entry per tenant and adapter; a flush does not wait for the gathering
window; a batch the registry refused is retried whole under its write id."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from loraplex.server.usage_recorder import UsageRecorder


class _Usage:
    """The registry's usage service as the recorder calls it: record_many, one call a transaction."""

    def __init__(self, failures: int = 0) -> None:
        self.transactions: list[tuple[str, list[tuple]]] = []  # (write id, entries)
        self.failures = failures
        self.lock = threading.Lock()

    def record_many(self, entries, write_id: str) -> tuple[str, ...]:
        with self.lock:
            if self.failures:
                self.failures -= 1
                raise OSError("database is locked")
            self.transactions.append((write_id, [(e.tenant, e.adapter, e.prompt_tokens, e.completion_tokens,
                                                  e.num_requests) for e in entries]))
        return ()

    @property
    def writes(self) -> list[tuple]:
        return [entry for _, entries in self.transactions for entry in entries]


def test_a_burst_of_finished_requests_is_one_write_per_tenant_and_adapter() -> None:
    usage = _Usage()
    recorder = UsageRecorder(SimpleNamespace(usage=usage), batch_window_s=0.5)  # type: ignore[arg-type]
    for i in range(100):
        recorder.record("acme" if i % 2 else "globex", "style" if i % 4 == 1 else None, 10, 1)
    time.sleep(0.05)  # within the window: nothing written yet
    assert usage.writes == []
    assert recorder.flush(5)
    assert len(usage.transactions) == 1
    assert sorted(usage.writes, key=str) == [("acme", "style", 250, 25, 25), ("acme", None, 250, 25, 25),
                                             ("globex", None, 500, 50, 50)]
    recorder.close()


def test_a_refused_batch_is_retried_whole_under_its_write_id_and_later_requests_go_in_a_new_one() -> None:
    usage = _Usage(failures=2)
    recorder = UsageRecorder(SimpleNamespace(usage=usage), batch_window_s=0.01)  # type: ignore[arg-type]
    recorder.record("acme", None, 3, 4)
    recorder.record("globex", "style", 1, 1)
    time.sleep(0.05)  # tried and refused once: closed
    recorder.record("acme", None, 5, 5)
    assert recorder.flush(10)
    (first_id, first), (second_id, second) = sorted(usage.transactions, key=lambda t: -len(t[1]))
    assert sorted(first, key=str) == [("acme", None, 3, 4, 1), ("globex", "style", 1, 1, 1)]
    assert second == [("acme", None, 5, 5, 1)] and second_id != first_id
    assert len(usage.transactions) == 2  # the refused batch written once, when the registry took it
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

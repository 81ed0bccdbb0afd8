"""Usage accounting off the request path: finished requests are queued here and written to the
registry (tokens in and out per tenant, adapter and hour) by one background thread, which
gathers the requests that finish within BATCH_WINDOW_S of the first into one write per (tenant,
adapter): a busy server writes a few times a second, not once per request (each write holds the
GIL for a millisecond or two beside the engine thread). `flush` and `close` do not wait for the
window. Nothing is dropped on a busy database: a failed write is retried; only a tenant or
adapter deleted meanwhile is skipped."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from loraplex.registry import Registry
from loraplex.registry.registry_errors import NotFoundError

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 5
BATCH_WINDOW_S = 0.25
_FLUSH = object()


@dataclass(frozen=True)
class UsageItem:
    tenant: str
    adapter: str | None
    prompt_tokens: int
    completion_tokens: int
    at: datetime


class UsageRecorder:
    def __init__(self, registry: Registry, batch_window_s: float = BATCH_WINDOW_S) -> None:
        self._registry = registry
        self._batch_window_s = batch_window_s
        # Finished requests; _FLUSH: write what is there now; None: write it and stop.
        self._queue: queue.SimpleQueue[UsageItem | object | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._num_queued = 0
        self._num_done = 0
        self._thread = threading.Thread(target=self._run, name="loraplex-usage", daemon=True)
        self._thread.start()

    def record(self, tenant: str, adapter: str | None, prompt_tokens: int, completion_tokens: int) -> None:
        """Queue one finished request (never blocks)."""
        with self._done:
            self._num_queued += 1
        self._queue.put(UsageItem(tenant, adapter, prompt_tokens, completion_tokens,
                                  datetime.now(timezone.utc)))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything queued before this call is written (blocking)."""
        with self._done:
            target = self._num_queued
        self._queue.put(_FLUSH)
        with self._done:
            return self._done.wait_for(lambda: self._num_done >= target, timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            batch = self._gather()
            items = [i for i in batch if isinstance(i, UsageItem)]
            self._write(items)
            with self._done:
                self._num_done += len(items)
                self._done.notify_all()
            if None in batch:
                return

    def _gather(self) -> list[UsageItem | object | None]:
        """The next batch: what arrives within the window of the first item, or until a flush
        or close asks for it."""
        batch = [self._queue.get()]
        deadline = time.monotonic() + self._batch_window_s
        while isinstance(batch[-1], UsageItem):
            try:
                batch.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        while not self._queue.empty():
            batch.append(self._queue.get())
        return batch

    def _write(self, items: list[UsageItem]) -> None:
        totals: dict[tuple[str, str | None, datetime], list[int]] = {}
        for item in items:
            hour = item.at.replace(minute=0, second=0, microsecond=0)
            counts = totals.setdefault((item.tenant, item.adapter, hour), [0, 0, 0])
            counts[0] += 1
            counts[1] += item.prompt_tokens
            counts[2] += item.completion_tokens
        for (tenant, adapter, hour), (num_requests, prompt, completion) in totals.items():
            self._write_one(tenant, adapter, hour, num_requests, prompt, completion)

    def _write_one(self, tenant: str, adapter: str | None, hour: datetime, num_requests: int,
                   prompt_tokens: int, completion_tokens: int) -> None:
        for attempt in range(MAX_ATTEMPTS):
            try:
                self._registry.usage.record(tenant, adapter, prompt_tokens=prompt_tokens,
                                            completion_tokens=completion_tokens,
                                            num_requests=num_requests, at=hour)
                return
            except NotFoundError:
                logger.info("usage of deleted tenant %s not recorded", tenant)
                return
            except Exception:
                logger.warning("could not record usage of tenant %s (attempt %d)", tenant,
                               attempt + 1, exc_info=True)
                time.sleep(0.2 * 2**attempt)
        logger.error("usage of tenant %s lost: %d requests, %d+%d tokens", tenant, num_requests,
                     prompt_tokens, completion_tokens)

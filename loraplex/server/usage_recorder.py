"""Usage accounting off the request path: finished requests are queued here and written to the
registry (tokens in and out per tenant, adapter and hour) by one background thread, which
gathers the requests that finish within BATCH_WINDOW_S of the first into one transaction, summed
per (tenant, adapter, hour): a busy server writes a few times a second, not once per request or
once per adapter (each transaction holds the GIL for a millisecond or two beside the engine
thread, and 1,000 adapters' requests finish under many adapters at once). `flush` and `close` do
not wait for the window.

Nothing is dropped while the database is unavailable or full: what could not be written stays
buffered, each batch summed per (tenant, adapter, hour) (a batch a try at most: the buffer grows
by at most one entry per tenant, adapter and hour every RETRY_S of an outage), and is written
when the database answers again (retried every RETRY_S at most). Each write is one
transaction carrying an id of its own: a write retried after its answer was lost (the COMMIT
reached the database, the answer did not come back) finds its id there and adds nothing, so no
request is counted twice. A batch that was tried is closed: requests that finish later go into a
new one. Only a tenant deleted meanwhile is skipped, and what is still buffered when the
process stops after CLOSE_RETRY_S of trying is logged as lost. A process killed outright loses what
is buffered: the requests of the last BATCH_WINDOW_S (plus any outage under way)."""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from loraplex.registry import Registry
from loraplex.registry.usage_service import UsageEntry

logger = logging.getLogger(__name__)

BATCH_WINDOW_S = 0.25
RETRY_S = 1.0
"""Longest wait between two attempts to write what the database refused (the first waits 0.1 s,
each next twice as long)."""
CLOSE_RETRY_S = 10.0
"""How long `close` keeps trying to write what is buffered before it gives up."""
_FLUSH = object()


@dataclass
class _Group:
    """The buffered usage of one (tenant, adapter, hour)."""

    num_items: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


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
        self._close_deadline: float | None = None
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

    def close(self, timeout_s: float = CLOSE_RETRY_S + 5) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        # The open batch, (tenant, adapter, hour) -> a group, takes requests until it is tried;
        # then it is closed under a write id of its own, kept for every retry.
        batch: dict[tuple[str, str | None, datetime], _Group] = {}
        closed: dict[str, dict[tuple[str, str | None, datetime], _Group]] = {}
        is_closing, delay = False, 0.0
        while True:
            items = self._gather(timeout_s=delay if closed else None)
            is_closing = is_closing or None in items
            for item in items:
                if isinstance(item, UsageItem):
                    group = batch.setdefault((item.tenant, item.adapter, _hour(item.at)), _Group())
                    group.num_items += 1
                    group.prompt_tokens += item.prompt_tokens
                    group.completion_tokens += item.completion_tokens
            if batch:
                closed[secrets.token_hex(16)], batch = batch, {}
            num_written = self._write(closed)
            with self._done:
                self._num_done += num_written
                self._done.notify_all()
            delay = 0.0 if not closed else min(RETRY_S, max(0.1, delay * 2))
            if is_closing and (not closed or self._is_past_close()):
                break
        for groups in closed.values():
            for (tenant, adapter, _), group in groups.items():
                logger.error("usage of tenant %s (adapter %s) lost: %d requests, %d+%d tokens", tenant,
                             adapter, group.num_items, group.prompt_tokens, group.completion_tokens)

    def _is_past_close(self) -> bool:
        if self._close_deadline is None:
            self._close_deadline = time.monotonic() + CLOSE_RETRY_S
        return time.monotonic() > self._close_deadline

    def _gather(self, timeout_s: float | None) -> list[UsageItem | object | None]:
        """The next batch: what arrives within the window of the first item, or until a flush
        or close asks for it. With `timeout_s`, an empty batch once it has passed (time to
        retry what is buffered)."""
        try:
            batch = [self._queue.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        deadline = time.monotonic() + self._batch_window_s
        while isinstance(batch[-1], UsageItem):
            try:
                batch.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        while not self._queue.empty():
            batch.append(self._queue.get())
        return batch

    def _write(self, closed: dict[str, dict[tuple[str, str | None, datetime], _Group]]) -> int:
        """Write each closed batch in one transaction under its write id; those written leave
        `closed`, the others stay for a retry. Returns how many requests left it."""
        num_done = 0
        for write_id, groups in list(closed.items()):
            entries = [UsageEntry(tenant, adapter, group.prompt_tokens, group.completion_tokens,
                                  group.num_items, hour) for (tenant, adapter, hour), group in groups.items()]
            try:
                skipped = self._registry.usage.record_many(entries, write_id=write_id)
            except Exception as exc:
                tenants = sorted({tenant for tenant, _, _ in groups})
                logger.warning("usage of tenant%s %s kept for a later write (%d requests): %s",
                               "s" if len(tenants) > 1 else "", ", ".join(tenants),
                               sum(g.num_items for g in groups.values()), exc)
                continue
            for tenant in skipped:
                logger.info("usage of deleted tenant %s not recorded", tenant)
            del closed[write_id]
            num_done += sum(group.num_items for group in groups.values())
        return num_done


def _hour(at: datetime) -> datetime:
    return at.replace(minute=0, second=0, microsecond=0)

"""Blocking calls on a few worker threads, shared fairly between tenants: each worker owns one
copy of a resource (a tokenizer: Hugging Face fast tokenizers are not safe to share between
threads), a tenant runs at most `max_per_tenant` calls at once, and a free worker takes the
oldest call of the tenant whose last call started longest ago (a newcomer first). One tenant's
queue of long calls therefore never holds back another tenant's call by more than the calls
already running, and with two workers and one call a tenant, not at all. Scheduling happens on
the event loop only."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

R = TypeVar("R")
T = TypeVar("T")


@dataclass
class _Call:
    tenant: str
    fn: Callable[[Any], Any]
    result: asyncio.Future


@dataclass
class _Worker(Generic[R]):
    executor: ThreadPoolExecutor
    resource: R


class FairPool(Generic[R]):
    def __init__(self, resources: list[R], max_per_tenant: int, name: str, niceness: int = 0) -> None:
        """`niceness`: how much lower the workers' CPU priority is than the process's (their
        nice value, on Linux, which schedules threads on their own)."""
        if not resources or max_per_tenant < 1:
            raise ValueError("a FairPool needs at least one resource and max_per_tenant >= 1")
        self._idle = [_Worker(ThreadPoolExecutor(1, f"{name}-{i}", _lower_priority, (niceness,)), resource)
                      for i, resource in enumerate(resources)]
        self._workers = list(self._idle)
        self._max_per_tenant = max_per_tenant
        self._queues: dict[str, deque[_Call]] = {}
        self._running: dict[str, int] = {}
        self._started_at: dict[str, int] = {}  # tenants with calls queued or running: their last start
        self._num_started = 0

    async def run(self, tenant: str, fn: Callable[[R], T]) -> T:
        """`fn(resource)` on a worker, in the tenant's turn. Cancelling the caller before the
        call starts drops it; once started it runs to the end (its result is discarded)."""
        call = _Call(tenant, fn, asyncio.get_running_loop().create_future())
        self._queues.setdefault(tenant, deque()).append(call)
        self._dispatch()
        return await call.result

    def close(self) -> None:
        for worker in self._workers:
            worker.executor.shutdown(wait=False, cancel_futures=True)

    def _dispatch(self) -> None:
        while self._idle:
            call = self._next_call()
            if call is None:
                return
            worker = self._idle.pop()
            self._running[call.tenant] = self._running.get(call.tenant, 0) + 1
            loop = asyncio.get_running_loop()
            future = worker.executor.submit(call.fn, worker.resource)
            future.add_done_callback(
                lambda done, c=call, w=worker, lp=loop: _call_soon(lp, self._finish, c, w, done))

    def _next_call(self) -> _Call | None:
        """The oldest call of the tenant that may start one and started its last longest ago."""
        for tenant, queue in list(self._queues.items()):
            while queue and queue[0].result.cancelled():
                queue.popleft()
            if not queue:
                del self._queues[tenant]
                self._forget_if_idle(tenant)
        ready = [t for t in self._queues if self._running.get(t, 0) < self._max_per_tenant]
        if not ready:
            return None
        tenant = min(ready, key=lambda t: self._started_at.get(t, -1))
        queue = self._queues[tenant]
        call = queue.popleft()
        if not queue:
            del self._queues[tenant]
        self._num_started += 1
        self._started_at[tenant] = self._num_started
        return call

    def _forget_if_idle(self, tenant: str) -> None:
        if tenant not in self._queues and tenant not in self._running:
            self._started_at.pop(tenant, None)

    def _finish(self, call: _Call, worker: _Worker[R], done: Future) -> None:
        self._idle.append(worker)
        self._running[call.tenant] -= 1
        if not self._running[call.tenant]:
            del self._running[call.tenant]
            self._forget_if_idle(call.tenant)
        if not call.result.cancelled():
            if done.cancelled():
                call.result.cancel()
            elif done.exception() is not None:
                call.result.set_exception(done.exception())
            else:
                call.result.set_result(done.result())
        self._dispatch()


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    if not loop.is_closed():  # a call still running when the server stopped has nobody to tell
        loop.call_soon_threadsafe(fn, *args)



def _lower_priority(niceness: int) -> None:
    if niceness and sys.platform == "linux":
        thread = threading.get_native_id()
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + niceness)

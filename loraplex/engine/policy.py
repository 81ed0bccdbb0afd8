"""Scheduling policies: the order in which waiting requests are admitted and which running
request is preempted when the KV cache runs short. The scheduler asks its policy for both and
decides nothing of the kind itself. Pure Python.

A policy owns the waiting queue (a request waits when it arrives and again after it is
preempted), so it can keep whatever structure its order needs."""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

from loraplex.engine.request import Request
from loraplex.engine.tenants import TenantTable


class SchedulingPolicy(ABC):
    def __init__(self, tenants: TenantTable) -> None:
        self.tenants = tenants

    @abstractmethod
    def add(self, request: Request) -> None:
        """`request` starts waiting: it arrived, or it was preempted."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """`request` stops waiting: it was admitted, aborted or failed."""

    @abstractmethod
    def waiting(self) -> Iterator[Request]:
        """The waiting requests in the order they should be admitted. The scheduler may stop
        early, and may skip a request that cannot run yet (its adapter is loading)."""

    @abstractmethod
    def choose_victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt when the KV cache runs short (`running` is never
        empty)."""

    @property
    @abstractmethod
    def num_waiting(self) -> int: ...


class FcfsPolicy(SchedulingPolicy):
    """First come, first served: admission by arrival (a preempted request keeps its place, so
    it resumes before anything that arrived after it); the newest running request is preempted
    first, so the oldest keep their progress. Tenants and weights play no part."""

    def __init__(self, tenants: TenantTable) -> None:
        super().__init__(tenants)
        self._queue: list[Request] = []  # ordered by arrival

    def add(self, request: Request) -> None:
        bisect.insort(self._queue, request, key=_arrival)

    def remove(self, request: Request) -> None:
        index = bisect.bisect_left(self._queue, request.arrival, key=_arrival)
        if index < len(self._queue) and self._queue[index] is request:
            del self._queue[index]

    def waiting(self) -> Iterator[Request]:
        return iter(list(self._queue))

    def choose_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=_arrival)

    @property
    def num_waiting(self) -> int:
        return len(self._queue)


def _arrival(request: Request) -> int:
    return request.arrival

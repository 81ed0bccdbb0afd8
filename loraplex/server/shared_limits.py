"""Tenant limits across replicas that share a PostgreSQL registry. Each replica's limiter counts
what it admits here (requests and tokens per tenant and second, requests in flight); every
`interval_s` one exchange, on a worker thread, adds those counts to the replica's rows in the
registry and reads back the other replicas' sums (loraplex.registry.rate_windows). The limiter
then checks its own exact counts plus the others' as of the last exchange. The event loop never
waits on the database; the price is a bound: a tenant may pass a limit by what the other
replicas admitted since their last exchange reached this one (two intervals plus the exchanges'
own time, when the database answers). If it does not answer, counts pile up here and are sent
when it does; meanwhile each replica enforces its own counts plus the others' last known ones.
Touched only from the event loop, like the limiter."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from loraplex.registry.rate_windows import SLOT_S, RemoteLoad
from loraplex.registry.registry_errors import RegistryUnavailableError

logger = logging.getLogger(__name__)

STALE_S = 10.0
"""A replica that has not written for this long (stopped, or cut off from the database) no longer
counts towards others' requests in flight; what it admitted still counts for its minute."""

Exchange = Callable[..., dict[int, RemoteLoad]]
"""loraplex.registry.rate_windows.RateWindowService.exchange."""


@dataclass(frozen=True)
class RemoteCharge:
    at: float
    """The end of the slot, on the limiter's clock: the latest the charge can have been made."""
    num_requests: int
    num_tokens: int


def replica_name() -> str:
    """This process's name in the rate windows: host, pid and a random part."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{secrets.token_hex(4)}"


class SharedLimits:
    def __init__(self, exchange: Exchange, interval_s: float, window_s: float, *,
                 replica: str | None = None, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._exchange = exchange
        self.interval_s = interval_s
        self.replica = replica or replica_name()
        self._window_slots = int(window_s // SLOT_S) + 1
        self._clock = clock
        self._wall_clock = wall_clock
        self._counts: dict[tuple[int, int], list[int]] = {}
        self._in_flight: dict[int, int] = {}
        self._remote: Mapping[int, RemoteLoad] = {}
        self._remote_offset = 0.0
        """Limiter clock minus wall clock when `_remote` was read."""
        self.num_exchanges = 0
        self._task: asyncio.Task | None = None

    def slot(self) -> int:
        return int(self._wall_clock()) // SLOT_S

    def add(self, tenant_id: int, slot: int, num_requests: int, num_tokens: int) -> None:
        """Count requests and tokens (negative: returned) against the tenant in `slot`."""
        counts = self._counts.setdefault((tenant_id, slot), [0, 0])
        counts[0] += num_requests
        counts[1] += num_tokens

    def set_in_flight(self, tenant_id: int, num: int) -> None:
        self._in_flight[tenant_id] = num

    def remote_in_flight(self, tenant_id: int) -> int:
        load = self._remote.get(tenant_id)
        return 0 if load is None else load.num_in_flight

    def remote_charges(self, tenant_id: int, now: float, window_s: float) -> list[RemoteCharge]:
        """The other replicas' charges still in the window that ends at `now`, oldest first."""
        load = self._remote.get(tenant_id)
        if load is None:
            return []
        charges = [RemoteCharge((s.slot + 1) * SLOT_S + self._remote_offset, s.num_requests, s.num_tokens)
                   for s in load.slots]
        return [c for c in charges if c.at > now - window_s]

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop exchanging, after sending what is left."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await self.exchange()

    async def exchange(self) -> None:
        """Send the counts since the last exchange and read the others' (on a worker thread)."""
        counts, self._counts = self._counts, {}
        in_flight = dict(self._in_flight)
        now_slot = self.slot()
        try:
            remote = await run_in_threadpool(
                self._exchange, self.replica, {k: (v[0], v[1]) for k, v in counts.items()}, in_flight,
                now_slot=now_slot, window_slots=self._window_slots, stale_slots=int(STALE_S // SLOT_S))
        except BaseException:
            for (tenant_id, slot), (num_requests, num_tokens) in counts.items():
                self.add(tenant_id, slot, num_requests, num_tokens)
            raise
        for tenant_id, num in in_flight.items():  # sent: a tenant at 0 need not be sent again
            if num == 0 and self._in_flight.get(tenant_id) == 0:
                del self._in_flight[tenant_id]
        self._remote = remote
        self._remote_offset = self._clock() - self._wall_clock()
        self.num_exchanges += 1

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.exchange()
            except asyncio.CancelledError:
                raise
            except RegistryUnavailableError as exc:  # an outage: said, not traced, 4 times a second
                logger.warning("could not exchange tenant load with the other replicas: %s", exc.message)
            except Exception:
                logger.warning("could not exchange tenant load with the other replicas", exc_info=True)

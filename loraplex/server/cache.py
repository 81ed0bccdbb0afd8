"""A small time-to-live cache for registry reads on the request path (keys, tenant limits,
adapter records). Thread-safe; bounded (cleared when full). `SingleFlight` shares one read among
the requests that miss the cache together (a burst of requests with one key).

A change made through this server (a revoked key, a deleted adapter) calls `forget`, and must
hold at once: a value read from the registry before that change, by a request still in flight,
must not be cached after it. So a reader takes the cache's `generation` before it reads and
passes it to `put`, which keeps the value only if nothing was forgotten in between.

While the registry database is unavailable, `read_cached` answers with a value past its time
(at most `max_stale_s` past it) rather than fail: a tenant whose key and adapter were read before
the outage keeps being served. Only a value read from the registry is ever reused this way."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from starlette.concurrency import run_in_threadpool

from loraplex.registry.registry_errors import RegistryUnavailableError

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
STALE_WAIT_S = 0.25
"""How long a request waits for a read that has not answered (an SQLite lock, a database that
does not answer) before it takes the stale value instead."""


class TTLCache(Generic[K, V]):
    def __init__(self, ttl_s: float, max_entries: int = 10_000, max_stale_s: float = 0.0) -> None:
        self._ttl_s = ttl_s
        self._max_stale_s = max_stale_s
        self._max_entries = max_entries
        self._entries: dict[K, tuple[V, float]] = {}
        self._lock = threading.Lock()
        self._generation = 0

    @property
    def generation(self) -> int:
        """Increases with every `forget`; take it before reading what `put` will store."""
        return self._generation

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        if entry is None or entry[1] < time.monotonic():
            return None
        return entry[0]

    def get_stale(self, key: K) -> V | None:
        """The value even past its time, up to `max_stale_s` past it (None otherwise)."""
        entry = self._entries.get(key)
        if entry is None or entry[1] + self._max_stale_s < time.monotonic():
            return None
        return entry[0]

    def put(self, key: K, value: V, read_at: int) -> V:
        """Keep `value` (read when the generation was `read_at`) unless something was
        forgotten since; returns it either way."""
        if self._ttl_s > 0:
            with self._lock:
                if read_at != self._generation:
                    return value
                if len(self._entries) >= self._max_entries:
                    self._entries.clear()
                self._entries[key] = (value, time.monotonic() + self._ttl_s)
        return value

    def forget(self, where: Callable[[K], bool] = lambda _: True) -> None:
        with self._lock:
            self._generation += 1
            for key in [k for k in self._entries if where(k)]:
                del self._entries[key]


class SingleFlight(Generic[K, V]):
    """Blocking loads run on worker threads, one at a time per key: the callers that ask for a
    key while its load runs await that load's result (or its error) instead of loading again.
    Nothing is kept once the load ends (the TTLCache keeps values). Use from one event loop.
    Give keys that change when the answer may (a TTLCache's generation): a caller that comes
    after a change must not be handed a load begun before it."""

    def __init__(self) -> None:
        self._loads: dict[K, asyncio.Future[V]] = {}

    async def run(self, key: K, load: Callable[[], V]) -> V:
        future = self._loads.get(key)
        if future is None:
            future = self._loads[key] = asyncio.ensure_future(run_in_threadpool(load))
            future.add_done_callback(lambda done: self._end(key, done))
        # A caller that is cancelled (its client left) leaves the load to the others.
        return await asyncio.shield(future)

    def _end(self, key: K, load: asyncio.Future[V]) -> None:
        del self._loads[key]
        if not load.cancelled():
            load.exception()  # retrieved: an error nobody was left to await is not logged


async def read_cached(cache: TTLCache[K, V], reads: SingleFlight[tuple[int, K], V], key: K,
                      load: Callable[[], V]) -> V:
    """`key`'s value from `cache`, else from `load` (a blocking registry read that puts what it
    reads into `cache`), shared by the callers that miss together. When the read fails with
    RegistryUnavailableError, or has not answered within STALE_WAIT_S, a value past its time is
    used if the cache still has one (the read goes on and refreshes the cache when it can). A
    read that answers otherwise (the key revoked, the adapter deleted) drops that value: a stale
    value outlives its time by one slow read at most, unless the registry is unavailable."""
    value = cache.get(key)
    if value is not None:
        return value

    def load_or_drop() -> V:
        try:
            return load()
        except RegistryUnavailableError:
            raise
        except Exception:
            if cache.get_stale(key) is not None:
                cache.forget(lambda cached: cached == key)
            raise

    read = reads.run((cache.generation, key), load_or_drop)
    stale = cache.get_stale(key)
    if stale is None:
        return await read
    try:
        return await asyncio.wait_for(read, STALE_WAIT_S)
    except (RegistryUnavailableError, asyncio.TimeoutError):  # not TimeoutError before 3.11
        return stale

"""A small time-to-live cache for registry reads on the request path (keys, tenant limits,
adapter records). Thread-safe; bounded (cleared when full)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TTLCache(Generic[K, V]):
    def __init__(self, ttl_s: float, max_entries: int = 10_000) -> None:
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._entries: dict[K, tuple[V, float]] = {}
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        if entry is None or entry[1] < time.monotonic():
            return None
        return entry[0]

    def put(self, key: K, value: V) -> V:
        if self._ttl_s > 0:
            with self._lock:
                if len(self._entries) >= self._max_entries:
                    self._entries.clear()
                self._entries[key] = (value, time.monotonic() + self._ttl_s)
        return value

    def forget(self, where: Callable[[K], bool] = lambda _: True) -> None:
        with self._lock:
            for key in [k for k in self._entries if where(k)]:
                del self._entries[key]

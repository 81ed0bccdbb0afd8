"""Who a presented API key speaks for, and the tenant's limits: registry reads behind a short
cache, so a busy server does not hit the database for every request, and requests that miss the
cache together (a burst with one key) share one read. Unknown keys are never cached. While the
database is unavailable, keys and limits read before are reused (cache.read_cached). From the
event loop: `principal_of`, `tenant_of`; `authenticate` and `tenant` block (database I/O)."""

from __future__ import annotations

import hashlib

from loraplex.registry import Registry
from loraplex.registry.records import Principal, TenantRecord
from loraplex.server.cache import SingleFlight, TTLCache, read_cached


class Principals:
    def __init__(self, registry: Registry, ttl_s: float, max_stale_s: float = 0.0) -> None:
        self._registry = registry
        self._keys: TTLCache[str, Principal] = TTLCache(ttl_s, max_stale_s=max_stale_s)
        self._tenants: TTLCache[str, TenantRecord] = TTLCache(ttl_s, max_stale_s=max_stale_s)
        self._key_reads: SingleFlight[tuple[int, str], Principal] = SingleFlight()
        self._tenant_reads: SingleFlight[tuple[int, str], TenantRecord] = SingleFlight()

    async def principal_of(self, presented: str) -> Principal:
        """Whom the key speaks for (AuthenticationError if nobody): cached, or read once for
        all the requests that present it meanwhile."""
        return await read_cached(self._keys, self._key_reads, _digest(presented),
                                 lambda: self.authenticate(presented))

    async def tenant_of(self, name: str) -> TenantRecord:
        return await read_cached(self._tenants, self._tenant_reads, name, lambda: self.tenant(name))

    def cached(self, presented: str) -> Principal | None:
        return self._keys.get(_digest(presented))

    def authenticate(self, presented: str) -> Principal:
        read_at = self._keys.generation
        return self._keys.put(_digest(presented), self._registry.keys.authenticate(presented), read_at)

    def tenant(self, name: str) -> TenantRecord:
        read_at = self._tenants.generation
        return self._tenants.put(name, self._registry.tenants.get(name), read_at)

    def forget(self) -> None:
        """After a change made through the admin API (a revoked key, new limits): from now on
        this server reads them anew, and no read already in flight is cached."""
        self._keys.forget()
        self._tenants.forget()


def _digest(presented: str) -> str:
    return hashlib.sha256(presented.encode("utf-8", "surrogatepass")).hexdigest()

"""From the registry to the engine. A request's `model` names one of its tenant's adapters; the
registry record (cached for a moment) gives the adapter's digest and blob paths. The engine
knows adapters by digest (their identity: two tenants who upload the same tensors share one
copy and one device slot), loaded lazily on first use through the same validation as uploads,
and dropped from host memory, least recently used first, past `max_host_adapters`. An adapter
is pinned while any request uses it, so it is never dropped under a running request. New
uploads are found without a restart; deleted ones stop being served once the cached record
expires (at once for deletions made through this server)."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from concurrent.futures import Future
from contextlib import asynccontextmanager

from starlette.concurrency import run_in_threadpool

from loraplex.adapter_format import BaseModelShape, LoraAdapter, load_adapter
from loraplex.engine.async_engine import AsyncEngine, EngineDeadError
from loraplex.registry import Registry
from loraplex.registry.records import AdapterRecord
from loraplex.registry.registry_errors import RegistryError
from loraplex.server.cache import TTLCache

logger = logging.getLogger(__name__)


class AdapterManager:
    def __init__(self, registry: Registry, engine: AsyncEngine, shape: BaseModelShape,
                 max_rank: int, max_host_adapters: int, ttl_s: float) -> None:
        self._registry = registry
        self._engine = engine
        self._shape = shape
        self._max_rank = max_rank
        self._max_host_adapters = max_host_adapters
        self._records: TTLCache[tuple[str, str], AdapterRecord] = TTLCache(ttl_s)
        self._loaded: OrderedDict[str, None] = OrderedDict()  # digests in the engine, LRU first
        self._loading: dict[str, asyncio.Future[None]] = {}
        self._pins: dict[str, int] = {}

    # Registry records -----------------------------------------------------------------------
    async def lookup(self, tenant: str, name: str) -> AdapterRecord:
        """The tenant's adapter `name`; AdapterNotFoundError (404 model_not_found) if it has
        none (another tenant's adapter of that name is not found either)."""
        key = (tenant, name)
        record = self._records.get(key)
        if record is None:
            read_at = self._records.generation
            record = self._records.put(key, await run_in_threadpool(
                self._registry.adapters.get, tenant, name), read_at)
        return record

    def forget(self, tenant: str, name: str | None = None) -> None:
        """Drop cached records of a tenant's adapter (or of all its adapters)."""
        self._records.forget(lambda key: key[0] == tenant and name in (None, key[1]))

    # Engine copies --------------------------------------------------------------------------
    @asynccontextmanager
    async def use(self, record: AdapterRecord) -> AsyncIterator[str]:
        """Load the adapter into the engine if needed and pin it; yields the engine's name for
        it (its digest)."""
        digest = record.digest
        self._pins[digest] = self._pins.get(digest, 0) + 1
        try:
            await self._ensure_loaded(record)
            yield digest
        finally:
            self._pins[digest] -= 1
            if not self._pins[digest]:
                del self._pins[digest]
            self._evict()

    @property
    def loaded(self) -> tuple[str, ...]:
        return tuple(self._loaded)

    async def _ensure_loaded(self, record: AdapterRecord) -> None:
        digest = record.digest
        if digest in self._loaded:
            self._loaded.move_to_end(digest)
            return
        future = self._loading.get(digest)
        if future is None:
            future = asyncio.ensure_future(self._load(record))
            self._loading[digest] = future
            future.add_done_callback(lambda _: self._loading.pop(digest, None))
        await asyncio.shield(future)  # a caller that leaves does not cancel others' load

    async def _load(self, record: AdapterRecord) -> None:
        adapter = await run_in_threadpool(self._read, record)
        await self._engine.add_adapter(record.digest, adapter)
        self._loaded[record.digest] = None
        logger.info("loaded adapter %s (first asked for as %s/%s) into the engine", record.digest[:16],
                    record.tenant, record.name)
        self._evict()

    def _read(self, record: AdapterRecord) -> LoraAdapter:
        try:
            adapter = load_adapter(record.config_path.read_bytes(), record.weights_path, self._shape,
                                   self._max_rank)
        except FileNotFoundError:
            raise RegistryError(f"the blobs of adapter {record.tenant}/{record.name} are missing "
                                f"from the blob store") from None
        if adapter.digest != record.digest:
            raise RegistryError(f"the blobs of adapter {record.tenant}/{record.name} do not match "
                                f"its recorded digest") from None
        return adapter

    def _evict(self) -> None:
        """Drop unpinned adapters, oldest use first, while more than the cap are held."""
        excess = len(self._loaded) - self._max_host_adapters
        for digest in list(self._loaded):
            if excess <= 0:
                return
            if digest in self._pins:
                continue
            del self._loaded[digest]
            excess -= 1
            try:
                self._engine.submit(lambda e, d=digest: e.remove_adapter(d)).add_done_callback(
                    _log_failure)
            except EngineDeadError:
                return
            logger.info("dropped adapter %s from host memory", digest[:12])


def _log_failure(future: Future) -> None:
    if future.exception() is not None:
        logger.warning("could not drop an adapter from the engine: %s", future.exception())

"""From the registry to the engine: a request's `model` names one of its tenant's adapters; the
registry record (cached for a moment) gives the adapter's digest, which is all the engine is
told. The engine owns both of its adapter tiers and reads an adapter when it needs it, through
`load`: digest -> the validated adapter, from the blob files of a record seen with that digest.
Two tenants who upload the same tensors share one digest, hence one host copy and one device
slot. New uploads are found without a restart; deleted ones stop being served once the cached
record expires (at once for deletions made through this server). While the database is
unavailable, records read before are reused (cache.read_cached)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from loraplex.adapter_format import BaseModelShape, LoraAdapter, load_adapter
from loraplex.registry import Registry
from loraplex.registry.records import AdapterRecord
from loraplex.registry.registry_errors import RegistryError
from loraplex.server.cache import SingleFlight, TTLCache, read_cached

logger = logging.getLogger(__name__)


class AdapterNames:
    def __init__(self, registry: Registry, shape: BaseModelShape, max_rank: int, ttl_s: float,
                 max_stale_s: float = 0.0) -> None:
        self._registry = registry
        self._shape = shape
        self._max_rank = max_rank
        self._records: TTLCache[tuple[str, str], AdapterRecord] = TTLCache(ttl_s, max_stale_s=max_stale_s)
        self._reads: SingleFlight[tuple[int, tuple[str, str]], AdapterRecord] = SingleFlight()
        self._blobs: dict[str, AdapterRecord] = {}  # digest -> a record whose blobs hold it
        self._names: dict[str, set[str]] = {}  # digest -> the names requests gave it here

    async def lookup(self, tenant: str, name: str) -> AdapterRecord:
        """The tenant's adapter `name`; AdapterNotFoundError (404 model_not_found) if it has
        none (another tenant's adapter of that name is not found either)."""
        key = (tenant, name)
        record = self._records.get(key)
        if record is None:  # one read for all the requests that ask meanwhile
            record = await read_cached(self._records, self._reads, key, lambda: self._read(key))
            self._blobs[record.digest] = record
            self._names.setdefault(record.digest, set()).add(name)
        return record

    def _read(self, key: tuple[str, str]) -> AdapterRecord:
        read_at = self._records.generation
        return self._records.put(key, self._registry.adapters.get(*key), read_at)

    def names_of(self, digest: str) -> tuple[str, ...]:
        """The names under which requests to this server asked for the adapter `digest` (its
        digest if none is known): what the endpoint picker's LoRA affinity matches `model`
        against."""
        return tuple(self._names.get(digest, ())) or (digest,)

    def forget(self, tenant: str, name: str | None = None) -> None:
        """Drop cached records of a tenant's adapter (or of all its adapters)."""
        self._records.forget(lambda key: key[0] == tenant and name in (None, key[1]))

    def load(self, digest: str) -> LoraAdapter:
        """The engine's adapter loader (runs on its loader thread): the adapter of `digest`,
        read and validated again from the blob store."""
        return self.locate(digest)()

    def locate(self, digest: str) -> functools.partial[LoraAdapter]:
        """Where the adapter of `digest` is: a call that reads and validates it, and pickles (an
        engine-core process reads the blob files itself, on its loader thread, so that the
        adapter's tensors never cross the pipe)."""
        record = self._blobs.get(digest)
        if record is None:
            raise RegistryError(f"no adapter with digest {digest[:12]} was asked for on this server")
        return functools.partial(read_blobs, digest, f"{record.tenant}/{record.name}", record.config_path,
                                 record.weights_path, self._shape, self._max_rank)


def read_blobs(digest: str, label: str, config_path: Path, weights_path: Path, shape: BaseModelShape,
               max_rank: int) -> LoraAdapter:
    """The adapter `label` (tenant/name) of `digest` from its blob files, validated; RegistryError
    if they are missing or hold another adapter."""
    try:
        adapter = load_adapter(config_path.read_bytes(), weights_path, shape, max_rank)
    except FileNotFoundError:
        raise RegistryError(f"the blobs of adapter {label} are missing from the blob store") from None
    if adapter.digest != digest:
        raise RegistryError(f"the blobs of adapter {label} do not match its recorded digest")
    logger.info("read adapter %s (asked for as %s) for the engine", digest[:16], label)
    return adapter

"""The engine's adapters: names (mutable aliases) mapped to digests (identity), and each
adapter's host-memory copy that the device slots are filled from."""

from __future__ import annotations

from pathlib import Path

import torch

from loraplex.adapter_format import LoraAdapter, load_adapter_dir
from loraplex.engine.lora_weights import HostAdapter, make_host_adapter
from loraplex.errors import UnknownAdapterError
from loraplex.model.model_config import ModelConfig


class AdapterStore:
    def __init__(self, config: ModelConfig, max_rank: int, dtype: torch.dtype, pin: bool) -> None:
        self.config, self.max_rank, self.dtype, self.pin = config, max_rank, dtype, pin
        self._digest_of: dict[str, str] = {}
        self._host: dict[str, HostAdapter] = {}
        self._info: dict[str, LoraAdapter] = {}

    def add(self, name: str, source: str | Path | LoraAdapter) -> str:
        """Register `name` for an adapter folder or a validated LoraAdapter; returns its
        digest. Re-adding a name points it at the new adapter (running requests keep theirs)."""
        adapter = source if isinstance(source, LoraAdapter) else load_adapter_dir(
            source, self.config.shape, self.max_rank)
        if adapter.digest not in self._host:
            self._host[adapter.digest] = make_host_adapter(adapter, self.config, self.dtype, self.pin)
            self._info[adapter.digest] = adapter
        self._digest_of[name] = adapter.digest
        return adapter.digest

    def add_prepared(self, name: str, host: HostAdapter) -> str:
        """Register an adapter already laid out for slot copies (benchmarks build these
        directly on the device)."""
        self._host.setdefault(host.digest, host)
        self._digest_of[name] = host.digest
        return host.digest

    def remove(self, name: str) -> str | None:
        """Forget a name; returns the digest if no other name uses it (its host copy is dropped
        by `drop` once no request needs it)."""
        digest = self._digest_of.pop(name, None)
        if digest is None:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded", param="adapter")
        return None if digest in self._digest_of.values() else digest

    def drop(self, digest: str) -> None:
        self._host.pop(digest, None)
        self._info.pop(digest, None)

    def resolve(self, name: str) -> str:
        digest = self._digest_of.get(name)
        if digest is None:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded", param="adapter")
        return digest

    def host(self, digest: str) -> HostAdapter:
        return self._host[digest]

    def info(self, digest: str) -> LoraAdapter | None:
        return self._info.get(digest)

    @property
    def names(self) -> dict[str, str]:
        return dict(self._digest_of)

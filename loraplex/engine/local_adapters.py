"""Adapters added by name through the offline API (`LLM.add_adapter`): names (mutable aliases)
mapped to digests (identity), and the source each digest is read from again whenever the engine's
host tier needs it (a folder, or an object the caller handed over). This is the loader of an
engine that serves no registry; the server brings its own (the blob store)."""

from __future__ import annotations

from pathlib import Path

from loraplex.adapter_format import BaseModelShape, LoraAdapter, load_adapter_dir
from loraplex.engine.lora_weights import HostAdapter
from loraplex.errors import AdapterError, UnknownAdapterError

AdapterSource = Path | LoraAdapter | HostAdapter


class LocalAdapters:
    def __init__(self, shape: BaseModelShape, max_rank: int) -> None:
        self.shape, self.max_rank = shape, max_rank
        self._digest_of: dict[str, str] = {}
        self._sources: dict[str, AdapterSource] = {}

    def add(self, name: str, source: str | Path | LoraAdapter | HostAdapter) -> str:
        """Register `name` for an adapter folder (validated now, read again when needed) or an
        adapter object; returns its digest. Re-adding a name points it at the new adapter."""
        if isinstance(source, (LoraAdapter, HostAdapter)):
            digest, kept = source.digest, source
        else:
            digest, kept = load_adapter_dir(source, self.shape, self.max_rank).digest, Path(source)
        self._sources[digest] = kept
        self._digest_of[name] = digest
        return digest

    def remove(self, name: str) -> str | None:
        """Forget a name; returns its digest if no other name uses it (the caller drops the
        source with `drop` once no request needs it)."""
        digest = self._digest_of.pop(name, None)
        if digest is None:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded", param="adapter")
        return None if digest in self._digest_of.values() else digest

    def drop(self, digest: str) -> None:
        if digest not in self._digest_of.values():
            self._sources.pop(digest, None)

    def resolve(self, name: str) -> str | None:
        return self._digest_of.get(name)

    @property
    def names(self) -> dict[str, str]:
        return dict(self._digest_of)

    def load(self, digest: str) -> LoraAdapter | HostAdapter:
        """The loader: the adapter of `digest`, read again from its folder if it came from one
        (refused if the folder changed since it was added)."""
        source = self._sources.get(digest)
        if source is None:
            raise UnknownAdapterError(f"adapter {digest[:12]} is not loaded", param="adapter")
        if not isinstance(source, Path):
            return source
        adapter = load_adapter_dir(source, self.shape, self.max_rank)
        if adapter.digest != digest:
            raise AdapterError(f"the adapter folder {source} changed since it was added")
        return adapter

"""Registered documents found in prompts that do not name them (issue 25): when a prompt holds
the exact tokens of one or more of its tenant's documents, the engine blends them as if the
request had named them (`documents`); `documents_blend: false` turns this off for a request,
`ServerConfig.min_found_document_tokens = 0` for the server.

Cheap on the request path: a tenant's document ids are read behind the registry cache (one
small query per `registry_cache_ttl_s`, none while cached), each document's tokens once (a
document is never edited, so its id names its tokens for good), and a prompt is scanned once,
looking its every run of KEY_TOKENS tokens up among the documents' first ones. A document is
found where its tokens, tokenized alone, lie whole in the prompt's, or all but its last, which
a BPE tokenizer may merge with the text after it (a document ending in a space or a newline,
before the template's newlines; that token is computed as the prompt's own). One whose first
token merged with the text before it is not found, and is computed as the prompt's own."""

from __future__ import annotations

from array import array

from starlette.concurrency import run_in_threadpool

from loraplex.registry import Registry
from loraplex.server.cache import SingleFlight, TTLCache, read_cached
from loraplex.server.codec import TextCodec

KEY_TOKENS = 4
"""Tokens of a document's start looked up at each prompt position (min_tokens is at least this)."""
MAX_INDEXED_TOKENS = 1 << 24
"""Documents' tokens kept (4 bytes each; past it the index is emptied and filled again)."""


class DocumentIndex:
    def __init__(self, registry: Registry, codec: TextCodec, min_tokens: int, ttl_s: float,
                 max_stale_s: float = 0.0) -> None:
        """`min_tokens`: documents shorter are never looked for (0: none is)."""
        self._registry, self._codec = registry, codec
        self.min_tokens = max(min_tokens, KEY_TOKENS) if min_tokens > 0 else 0
        self._ids: TTLCache[str, tuple[int, ...]] = TTLCache(ttl_s, max_stale_s=max_stale_s)
        self._id_reads: SingleFlight[tuple[int, str], tuple[int, ...]] = SingleFlight()
        self._tokens: dict[int, array | None] = {}
        """document id -> its tokens (int32), None when shorter than min_tokens."""
        self._num_tokens = 0

    def forget(self) -> None:
        """After a document was added or deleted through this server: tenants' ids are read anew."""
        self._ids.forget()

    async def find(self, tenant: str, prompt_ids: list[int]) -> tuple[tuple[int, int], ...]:
        """[start, end) of each of the tenant's documents found whole in `prompt_ids`, in order,
        not overlapping (where two start together, the longer)."""
        if not self.min_tokens or len(prompt_ids) < self.min_tokens:
            return ()
        documents = await self._documents_of(tenant)
        if not documents:
            return ()
        heads: dict[tuple[int, ...], list[array]] = {}
        for tokens in sorted(documents, key=len, reverse=True):
            heads.setdefault(tuple(tokens[:KEY_TOKENS]), []).append(tokens)
        prompt = array("i", prompt_ids)
        spans, i = [], 0
        while i <= len(prompt_ids) - self.min_tokens:
            end = next((i + length for tokens in heads.get(tuple(prompt_ids[i:i + KEY_TOKENS]), ())
                        for length in (len(tokens), len(tokens) - 1)  # whole, or its last token merged
                        if prompt[i:i + length] == tokens[:length]), None)
            if end is None:
                i += 1
            else:
                spans.append((i, end))
                i = end
        return tuple(spans)

    async def _documents_of(self, tenant: str) -> list[array]:
        ids = await read_cached(self._ids, self._id_reads, tenant, lambda: self._read_ids(tenant))
        if any(i not in self._tokens for i in ids):
            records = await run_in_threadpool(self._registry.documents.list, tenant)
            if self._num_tokens > MAX_INDEXED_TOKENS:
                self._tokens, self._num_tokens = {}, 0
            for record in records:
                if record.id not in self._tokens:
                    tokens = await self._codec.tokens(record.text)
                    self._tokens[record.id] = array("i", tokens) if len(tokens) >= self.min_tokens else None
                    self._num_tokens += len(tokens)
        return [tokens for i in ids if (tokens := self._tokens.get(i)) is not None]

    def _read_ids(self, tenant: str) -> tuple[int, ...]:
        read_at = self._ids.generation
        return self._ids.put(tenant, self._registry.documents.ids(tenant), read_at)

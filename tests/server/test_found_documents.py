"""Finding registered documents in prompts that do not name them (loraplex/server/found_documents.py),
over a registry and a tokenizer faked on the spot (a token a character): whole runs only, in
order, not overlapping, the longer where two start together; documents under the minimum never;
a tenant's list read again only after `forget` (or its time)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from loraplex.server.found_documents import DocumentIndex


class FakeDocuments:
    def __init__(self, texts: dict[int, str]) -> None:
        self.texts = texts
        self.num_list_reads = 0

    def ids(self, tenant: str) -> tuple[int, ...]:
        return tuple(sorted(self.texts))

    def list(self, tenant: str) -> tuple[SimpleNamespace, ...]:
        self.num_list_reads += 1
        return tuple(SimpleNamespace(id=i, text=text) for i, text in sorted(self.texts.items()))


class FakeCodec:
    async def tokens(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def _index(documents: FakeDocuments, min_tokens: int = 8) -> DocumentIndex:
    return DocumentIndex(SimpleNamespace(documents=documents), FakeCodec(), min_tokens, ttl_s=60.0)


def _find(index: DocumentIndex, prompt: str) -> tuple[tuple[int, int], ...]:
    return asyncio.run(index.find("acme", [ord(c) for c in prompt]))


def test_documents_are_found_whole_in_order_the_longer_first() -> None:
    documents = FakeDocuments({1: "abcdefghij", 2: "abcdefghijklmnop", 3: "zyxwvutsrq", 4: "short"})
    index = _index(documents)
    prompt = "..abcdefghijklmnop..zyxwvutsrq..abcdefghij..short..abcdefghi"
    assert _find(index, prompt) == ((2, 18), (20, 30), (32, 42))
    assert _find(index, "no document here at all") == ()
    assert _find(_index(documents, min_tokens=0), prompt) == ()  # finding turned off
    assert documents.num_list_reads == 1  # each document tokenized once


def test_a_new_document_counts_after_forget() -> None:
    documents = FakeDocuments({1: "abcdefghij"})
    index = _index(documents)
    assert _find(index, "..0123456789..") == ()
    documents.texts[2] = "0123456789"
    assert _find(index, "..0123456789..") == ()  # the tenant's ids are cached
    index.forget()
    assert _find(index, "..0123456789..") == ((2, 12),)

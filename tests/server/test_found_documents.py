"""Finding registered documents in prompts that do not name them (loraplex/server/found_documents.py),
over a registry and a tokenizer faked on the spot (a token a character): whole runs (or all but
their last token) only, in order, not overlapping, the longer where two start together; documents
under the minimum never; a tenant's list read again only after `forget` (or its time); and the
named documents' search (find_document), whole or less a merged edge token."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from loraplex.server.documents import find_document
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
    prompt = "..abcdefghijklmnop..zyxwvutsrq..abcdefghij..short..abcdefgh.."
    assert _find(index, prompt) == ((2, 18), (20, 30), (32, 42))  # (two tokens short: not found)
    assert _find(index, "no document here at all") == ()
    assert _find(_index(documents, min_tokens=0), prompt) == ()  # finding turned off
    assert documents.num_list_reads == 1  # each document tokenized once


def test_a_document_whose_last_token_merged_with_the_next_is_found_less_that_token() -> None:
    """(A BPE tokenizer merges a document's trailing space or newline with the template's
    newlines after it: here the last character stands for that token.)"""
    index = _index(FakeDocuments({1: "abcdefghij", 2: "abcdefghijklmnop"}))
    assert _find(index, "..abcdefghiX..abcdefghijklmnoY..") == ((2, 11), (14, 29))


def test_a_new_document_counts_after_forget() -> None:
    documents = FakeDocuments({1: "abcdefghij"})
    index = _index(documents)
    assert _find(index, "..0123456789..") == ()
    documents.texts[2] = "0123456789"
    assert _find(index, "..0123456789..") == ()  # the tenant's ids are cached
    index.forget()
    assert _find(index, "..0123456789..") == ((2, 12),)


def test_a_named_document_is_found_whole_or_less_a_merged_edge_token() -> None:
    prompt = [1, 2, 10, 11, 12, 13, 3, 20, 21, 22, 23, 4, 31, 32, 33, 5]
    assert find_document(prompt, [10, 11, 12, 13], 0) == (2, 6)  # whole
    assert find_document(prompt, [20, 21, 22, 99], 0) == (7, 10)  # its last token merged
    assert find_document(prompt, [98, 32, 33], 0) == (13, 15)  # its first
    assert find_document(prompt, [97, 21, 22, 96], 0) == (8, 10)  # both
    assert find_document(prompt, [10, 11, 12, 13], 6) is None  # only at or after `start`
    assert find_document(prompt, [7, 8, 9], 0) is None and find_document(prompt, [], 0) is None

"""Registered documents named in a request (`documents`, through the openai client's
`extra_body`): the tenant's own only (another tenant's name is unknown: 400). Chat puts their
texts, in order and each followed by a blank line, at the start of the last user message;
completions before the prompt. The engine is told where their tokens lie in the prompt
(`DocumentBlend`), found by their own tokens: a document whose tokens the template or a
neighbour merged with others is computed as the prompt's own. A request that names none has
the tenant's documents found in its prompt instead (loraplex/server/found_documents.py);
`documents_blend: false` turns both off, `documents_recompute_share` applies to both."""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from loraplex.engine.blending import DEFAULT_RECOMPUTE_SHARE, DocumentBlend
from loraplex.errors import InvalidRequestError
from loraplex.registry.records import DocumentRecord
from loraplex.registry.registry_errors import NotFoundError
from loraplex.server.schemas.openai import SamplingFields
from loraplex.server.services import Services

SEPARATOR = "\n\n"


async def requested_documents(services: Services, tenant: str, body: SamplingFields
                              ) -> tuple[DocumentRecord, ...]:
    """The tenant's documents the request names, in order (400 for one named twice or unknown)."""
    if body.documents is None:
        return ()
    names, seen = body.documents, set()
    for name in names:
        if name in seen:
            raise InvalidRequestError(f"document {name!r} is named twice in documents", param="documents")
        seen.add(name)
    try:
        return await run_in_threadpool(services.registry.documents.get_many, tenant, names)
    except NotFoundError as error:
        raise InvalidRequestError(str(error), param="documents") from None


def documents_text(records: tuple[DocumentRecord, ...]) -> str:
    return "".join(record.text + SEPARATOR for record in records)


def with_documents(messages: list[dict[str, Any]],
                   records: tuple[DocumentRecord, ...]) -> list[dict[str, Any]]:
    """The messages with the documents at the start of the last user message."""
    last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "user"), None)
    if last is None:
        raise InvalidRequestError("documents go at the start of the last user message, and the request has "
                                  "no user message", param="documents")
    content = messages[last]["content"]
    if not isinstance(content, str):
        raise InvalidRequestError("documents go before the last user message's text: give its content as "
                                  "a string", param="documents")
    return [*messages[:last], {**messages[last], "content": documents_text(records) + content},
            *messages[last + 1:]]


async def document_blend(services: Services, tenant: str, body: SamplingFields, prompt_ids: list[int],
                         records: tuple[DocumentRecord, ...]) -> DocumentBlend | None:
    """Where the named documents' tokens lie in the prompt (with none named, where the tenant's
    documents are found in it), for the engine to blend (None: a full prefill, as
    `documents_blend: false` asks, or nothing to blend)."""
    if body.documents_blend is False:
        return None
    share = body.documents_recompute_share
    share = DEFAULT_RECOMPUTE_SHARE if share is None else share
    if not records:
        found = await services.documents.find(tenant, prompt_ids)
        return DocumentBlend(found, share) if found else None
    spans, start = [], 0
    for record in records:
        tokens = await services.codec.encode(record.text, tenant, param="documents", add_special_tokens=False)
        span = find_document(prompt_ids, tokens, start)
        if span is not None:
            spans.append(span)
            start = span[1]
    return DocumentBlend(tuple(spans), share) if spans else None


def find_document(token_ids: list[int], tokens: list[int], start: int) -> tuple[int, int] | None:
    """[start, end) of a document's `tokens` (tokenized alone) in the prompt, at or after
    `start`: whole, else less its last token, its first, or both, which a BPE tokenizer may
    have merged with the text around them (SmolLM2-Instruct's: a document that ends in a space
    or a newline ends in another token before the separator's newlines; 47 of 600 placements of
    documentation texts, each found less its last token). The rest of the document is blended,
    the merged tokens computed as the prompt's own."""
    for lo, hi in ((0, len(tokens)), (0, len(tokens) - 1), (1, len(tokens)), (1, len(tokens) - 1)):
        if hi - lo < 1:
            continue
        found = find_run(token_ids, tokens[lo:hi], start)
        if found is not None:
            return found, found + hi - lo
    return None


def find_run(token_ids: list[int], run: list[int], start: int) -> int | None:
    """Where `run` first occurs in token_ids at or after `start` (None: nowhere)."""
    if not run:
        return None
    first, size = run[0], len(run)
    for i in range(start, len(token_ids) - size + 1):
        if token_ids[i] == first and token_ids[i:i + size] == run:
            return i
    return None

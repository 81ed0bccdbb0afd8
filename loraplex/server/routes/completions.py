"""POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import APIRouter, Request, Response

from loraplex import __version__
from loraplex.errors import InvalidRequestError
from loraplex.server.admission import AdmissionDep
from loraplex.server.auth import TenantDep
from loraplex.server.deps import ServicesDep
from loraplex.server.documents import document_blend, documents_text, requested_documents
from loraplex.server.generation import (
    Choice,
    Job,
    compile_constraint,
    prompt_logprobs_of,
    resolve_model,
    run_job,
    sampling_params,
    token_logprobs,
    truncated,
    usage_counts,
    usage_of,
)
from loraplex.server.http_errors import stream_error
from loraplex.server.request_id import request_id_of
from loraplex.server.routes.docs import INFERENCE_ERRORS
from loraplex.server.schemas.openai import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
)
from loraplex.server.services import Services
from loraplex.server.streaming import DONE, ChunkEvents, sse
from loraplex.server.system_prompts import find_system_prompt, pin_system_prompt
from loraplex.types import RequestOutput, TokenLogprob

router = APIRouter(prefix="/v1", tags=["OpenAI API"])
FINGERPRINT = f"loraplex-{__version__}"
DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for completions."""
STREAM_RESPONSE = {
    "description": "With `stream: true`: events whose `data` is a JSON chunk (the usage chunk last, "
                   "with `choices: []`, if `stream_options.include_usage`; the usage so far in "
                   "every chunk if `stream_options.continuous_usage_stats`), or an `error` object "
                   "if generation fails after the stream began; then `data: [DONE]`.",
    "content": {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"],
        "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}},
}


@router.post("/completions", response_model=Completion, summary="Complete a prompt",
             responses={**INFERENCE_ERRORS, 200: STREAM_RESPONSE})
async def create_completion(body: CompletionRequest, principal: TenantDep, services: ServicesDep,
                            request: Request, admission: AdmissionDep) -> Completion | Response:
    """Generate text after `prompt` with the base model or one of your adapters (`model`).
    With `stream: true` the answer comes as server-sent events; leaving the stream stops the
    generation. `echo` with `logprobs` scores the prompt's own tokens (with `max_tokens: 0`,
    nothing else), as likelihood evaluations do."""
    arrival = time.monotonic()
    adapter = await resolve_model(services, principal.tenant, body.model)
    prompt = body.prompt
    documents = await requested_documents(services, principal.tenant, body)
    if documents:
        if not isinstance(prompt, str):
            raise InvalidRequestError("documents go before a text prompt, not token ids", param="documents")
        prompt = documents_text(documents) + prompt
    if body.system_prompt is not None:
        record = await find_system_prompt(services, principal.tenant, body.system_prompt, adapter)
        if not isinstance(prompt, str):
            raise InvalidRequestError("a registered system_prompt goes before a text prompt, not token ids",
                                      param="system_prompt")
        prompt = record.text + prompt
        await pin_system_prompt(services, record, await _prompt_token_ids(
            services, record.text, principal.tenant, body.add_special_tokens), "completions")
    prompt_ids = truncated(body, await _prompt_token_ids(services, prompt, principal.tenant,
                                                         body.add_special_tokens))
    echo_logprobs = body.logprobs if body.echo else None
    asked = [n for n in (echo_logprobs, body.prompt_logprobs) if n is not None]
    params = sampling_params(services, body, len(prompt_ids), max_tokens=body.max_tokens,
                             default_max_tokens=DEFAULT_MAX_TOKENS, logprobs=body.logprobs,
                             prompt_param="prompt", prompt_logprobs=max(asked, default=None),
                             scores_prompt=bool(body.echo))
    job = Job(request_id_of(request.scope), principal.tenant, body.model, adapter, prompt_ids, params,
              arrival, admission, n=body.n or 1, grammar=await compile_constraint(services, params),
              documents=await document_blend(services, principal.tenant, body, prompt_ids, documents))
    outputs = await run_job(request, services, job, stream=bool(body.stream),
                            events=lambda first, rest: _events(services, job, body, first, rest))
    if isinstance(outputs, Response):
        return outputs
    echo = await _echo(services, body, outputs[0])  # the first choice scored the prompt
    prompt_logprobs = None
    if body.prompt_logprobs is not None:
        prompt_logprobs = await prompt_logprobs_of(services, outputs[0], body.prompt_logprobs)
    choices = []
    for index, output in enumerate(outputs):
        logprobs = None
        if body.logprobs is not None:
            entries = echo.entries + token_logprobs(output, newest_only=False)
            logprobs = await _logprobs(services, echo.token_ids + output.token_ids, entries, body.logprobs,
                                       offset=0)
        choices.append(CompletionChoice(index=index, text=echo.text + output.text,
                                        finish_reason=output.finish_reason, logprobs=logprobs,
                                        prompt_logprobs=prompt_logprobs))
    return Completion(id=f"cmpl-{job.request_id}", created=int(time.time()), model=job.model,
                      system_fingerprint=FINGERPRINT, choices=choices, usage=usage_of(outputs))


@dataclass(frozen=True)
class Echo:
    """What `echo` puts before the completion: the prompt's text, and its tokens with their
    log-probabilities when `logprobs` is asked (none of the first token)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    entries: list[TokenLogprob | None] = field(default_factory=list)


async def _echo(services: Services, body: CompletionRequest, output: RequestOutput) -> Echo:
    if not body.echo:
        return Echo()
    prompt_ids = output.prompt_token_ids
    if isinstance(body.prompt, str) and body.truncate_prompt_tokens is None:
        text = body.prompt
    else:
        text = await services.codec.decode(prompt_ids)
    if body.logprobs is None:
        return Echo(text)
    return Echo(text, list(prompt_ids), list(output.prompt_logprobs or [None] * len(prompt_ids)))


async def _prompt_token_ids(services: Services, prompt: str | list[int], tenant: str,
                            add_special_tokens: bool | None) -> list[int]:
    if isinstance(prompt, str):
        return await services.codec.encode(prompt, tenant, add_special_tokens=add_special_tokens is not False)
    vocab = services.llm.model_config.vocab_size
    if not all(0 <= token < vocab for token in prompt):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
    return list(prompt)


async def _events(services: Services, job: Job, body: CompletionRequest, first: Choice,
                  rest: AsyncIterator[Choice]) -> AsyncIterator[str]:
    events = ChunkEvents({"id": f"cmpl-{job.request_id}", "object": "text_completion",
                          "created": int(time.time()), "model": job.model, "system_fingerprint": FINGERPRINT})
    num_prompt = len(first[1].prompt_token_ids)
    echo = await _echo(services, body, first[1])  # goes before each choice's first text
    echoed: set[int] = set()
    latest: dict[int, RequestOutput] = {}  # each choice's latest output: the usage so far counts all
    no_echo = Echo()
    has_logprobs, include_usage, continuous_usage = body.logprobs is not None, body.include_usage, \
        body.continuous_usage  # read once, not at every token
    try:
        choice: Choice | None = first
        while choice is not None:
            index, output = choice
            latest[index] = output
            prefix = no_echo if index in echoed else echo
            if output.new_text or output.finished or has_logprobs or prefix.text:
                logprobs = None
                if has_logprobs:
                    offset = (0 if prefix.text else len(echo.text)) + len(output.text) - len(output.new_text)
                    logprobs = await _logprobs(services, prefix.token_ids + output.new_token_ids,
                                               prefix.entries + token_logprobs(output, newest_only=True),
                                               body.logprobs, offset=offset)
                item = {"index": index, "text": prefix.text + output.new_text, "finish_reason":
                        output.finish_reason if output.finished else None,
                        "logprobs": logprobs.model_dump() if logprobs else None}
                if include_usage:
                    usage = usage_counts(num_prompt, latest.values()) if continuous_usage else None
                    yield events.event([item], usage)
                else:
                    yield events.event([item])
                echoed.add(index)
            choice = await anext(rest, None)
        if body.include_usage:
            yield events.event([], usage_counts(num_prompt, latest.values()))
    except Exception as exc:  # after the stream began: an error event, then the end
        yield sse(stream_error(exc, job.request_id))
    yield DONE


async def _logprobs(services: Services, token_ids: list[int], entries: list[TokenLogprob | None],
                    num_top: int, *, offset: int) -> CompletionLogprobs:
    """OpenAI's completions logprobs of `token_ids` (an entry each; None: no logprob, as an
    echoed prompt's first token), their text starting at `offset` of the choice's text."""
    alternatives = [t for e in entries if e is not None for t in list(e.top)[:num_top]]
    texts = await services.codec.token_texts(list(token_ids) + alternatives)
    tokens, rest = texts[:len(token_ids)], iter(texts[len(token_ids):])
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    top_logprobs: list[dict[str, float] | None] = []
    for entry in entries:
        if entry is None:
            top_logprobs.append(None)
            continue
        top: dict[str, float] = {}
        for logprob in list(entry.top.values())[:num_top]:  # tokens that decode alike keep the best
            text = next(rest)
            top[text] = max(logprob, top.get(text, logprob))
        top_logprobs.append(top)
    return CompletionLogprobs(tokens=tokens, top_logprobs=top_logprobs, text_offset=offsets,
                              token_logprobs=[None if e is None else e.logprob for e in entries])

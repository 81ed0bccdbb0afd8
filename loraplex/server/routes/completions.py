"""POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response

from loraplex import __version__
from loraplex.errors import InvalidRequestError
from loraplex.server.admission import AdmissionDep
from loraplex.server.auth import TenantDep
from loraplex.server.deps import ServicesDep
from loraplex.server.generation import (
    Job,
    resolve_model,
    run_job,
    sampling_params,
    token_logprobs,
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
from loraplex.server.streaming import DONE, sse
from loraplex.types import RequestOutput

router = APIRouter(prefix="/v1", tags=["OpenAI API"])
FINGERPRINT = f"loraplex-{__version__}"
DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for completions."""
STREAM_RESPONSE = {
    "description": "With `stream: true`: events whose `data` is a JSON chunk (the usage chunk last, "
                   "with `choices: []`, if `stream_options.include_usage`), or an `error` object "
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
    generation."""
    arrival = time.monotonic()
    adapter = await resolve_model(services, principal.tenant, body.model)
    prompt_ids = await _prompt_token_ids(services, body.prompt, principal.tenant)
    params = sampling_params(services, body, len(prompt_ids), max_tokens=body.max_tokens,
                             default_max_tokens=DEFAULT_MAX_TOKENS, logprobs=body.logprobs,
                             prompt_param="prompt")
    job = Job(request_id_of(request.scope), principal.tenant, body.model, adapter, prompt_ids, params,
              arrival, admission)
    last = await run_job(request, services, job, stream=bool(body.stream),
                         events=lambda first, outputs: _events(services, job, body, first, outputs))
    if isinstance(last, Response):
        return last
    return Completion(
        id=f"cmpl-{job.request_id}", created=int(time.time()), model=job.model,
        system_fingerprint=FINGERPRINT,
        choices=[CompletionChoice(text=last.text, finish_reason=last.finish_reason,
                                  logprobs=await _logprobs(services, last, body.logprobs))],
        usage=usage_of(last),
    )


async def _prompt_token_ids(services: Services, prompt: str | list[int], tenant: str) -> list[int]:
    if isinstance(prompt, str):
        return await services.codec.encode(prompt, tenant)
    vocab = services.llm.model_config.vocab_size
    if not all(0 <= token < vocab for token in prompt):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
    return list(prompt)


async def _events(services: Services, job: Job, body: CompletionRequest, first: RequestOutput,
                  outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
    base = {"id": f"cmpl-{job.request_id}", "object": "text_completion", "created": int(time.time()),
            "model": job.model, "system_fingerprint": FINGERPRINT}
    usage = {"usage": None} if body.include_usage else {}
    output: RequestOutput | None = first
    try:
        while output is not None:
            if output.new_text or output.finished or body.logprobs is not None:
                logprobs = await _logprobs(services, output, body.logprobs, newest_only=True)
                choice = {"index": 0, "text": output.new_text, "finish_reason": output.finish_reason
                          if output.finished else None,
                          "logprobs": logprobs.model_dump() if logprobs else None}
                yield sse(base | {"choices": [choice]} | usage)
            last, output = output, (None if output.finished else await anext(outputs, None))
        if body.include_usage:
            yield sse(base | {"choices": [], "usage": usage_of(last).model_dump()})
    except Exception as exc:  # after the stream began: an error event, then the end
        yield sse(stream_error(exc, job.request_id))
    yield DONE


async def _logprobs(services: Services, output: RequestOutput, requested: int | None, *,
                    newest_only: bool = False) -> CompletionLogprobs | None:
    """The log-probabilities of all output tokens, or of this step's (when streaming)."""
    if requested is None or output.logprobs is None:
        return None
    entries = token_logprobs(output, newest_only)
    texts = await services.codec.token_texts(
        [e.token_id for e in entries] + [t for e in entries for t in e.top])
    tokens, alternatives = texts[:len(entries)], iter(texts[len(entries):])
    offsets, offset = [], len(output.text) - len(output.new_text) if newest_only else 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    top_logprobs = []
    for entry in entries:
        top: dict[str, float] = {}
        for logprob in entry.top.values():  # tokens that decode alike keep the best
            text = next(alternatives)
            top[text] = max(logprob, top.get(text, logprob))
        top_logprobs.append(top)
    return CompletionLogprobs(tokens=tokens, token_logprobs=[e.logprob for e in entries],
                              top_logprobs=top_logprobs, text_offset=offsets)

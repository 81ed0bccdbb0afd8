"""One generation request, whichever API it came through: the model it names, its sampling
parameters checked against the context and the server's caps, admission (server queue and the
tenant's limits), the engine stream (the engine is told the adapter's digest and the tenant),
and at the end the accounting (limits released, usage recorded, metrics) however the request ended."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request, Response

from loraplex.errors import ContextLengthError, InvalidRequestError, LoraplexError
from loraplex.registry.names import NAME_PATTERN
from loraplex.registry.records import AdapterRecord
from loraplex.registry.registry_errors import AdapterNotFoundError
from loraplex.server.http_errors import RateLimitError
from loraplex.server.limits import Admission
from loraplex.server.schemas.openai import PromptLogprob, PromptLogprobs, SamplingFields, Usage
from loraplex.server.services import Services
from loraplex.server.streaming import ClientDisconnected, EventStreamResponse, until_disconnect
from loraplex.types import RequestOutput, SamplingParams, TokenLogprob

logger = logging.getLogger(__name__)


class InvalidValueError(InvalidRequestError):
    code = "invalid_value"


class EngineRequestError(LoraplexError):
    """The engine failed while running the request (answered 500; details in the log)."""

    code = "engine_error"


@dataclass(frozen=True)
class Job:
    request_id: str
    tenant: str
    model: str
    """As the request named it."""
    adapter: AdapterRecord | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    """time.monotonic() when the request arrived."""
    admission: Admission
    """Its place under the server's and the tenant's limits: released when the job ends."""


async def resolve_model(services: Services, tenant: str, model: str) -> AdapterRecord | None:
    """None for the base model, else the tenant's adapter of that name (404 otherwise)."""
    if model == services.config.model_id:
        return None
    try:
        if not NAME_PATTERN.fullmatch(model):  # no adapter has such a name: do not ask
            raise AdapterNotFoundError(model)
        return await services.adapters.lookup(tenant, model)
    except AdapterNotFoundError:
        raise AdapterNotFoundError(f"The model `{model}` does not exist or you do not have access "
                                   f"to it.", param="model") from None


def truncated(body: SamplingFields, prompt_token_ids: list[int]) -> list[int]:
    """The prompt after `truncate_prompt_tokens` (its last tokens)."""
    keep = body.truncate_prompt_tokens
    return prompt_token_ids[-keep:] if keep is not None else prompt_token_ids


def sampling_params(
    services: Services, body: SamplingFields, num_prompt_tokens: int, *, max_tokens: int | None,
    default_max_tokens: int | None, logprobs: int | None, prompt_param: str,
    prompt_logprobs: int | None = None, scores_prompt: bool = False,
) -> SamplingParams:
    """SamplingParams for a request, after the checks that need the prompt's length.
    `scores_prompt`: the answer is about the prompt itself (echo, prompt logprobs), so
    `max_tokens: 0` makes sense."""
    if max_tokens == 0 and not (scores_prompt or prompt_logprobs is not None):
        raise InvalidValueError("max_tokens: 0 generates nothing; it needs echo or prompt_logprobs",
                                param="max_tokens")
    if body.prompt_logprobs is not None and body.stream:
        raise InvalidValueError("prompt_logprobs cannot be streamed", param="prompt_logprobs")
    context, cap = services.llm.max_model_len, services.config.max_tokens_limit
    if num_prompt_tokens > services.max_prompt_tokens:
        raise ContextLengthError(
            f"This model's maximum context length is {context} tokens; the prompt has "
            f"{num_prompt_tokens} tokens (at most {services.max_prompt_tokens} are accepted).",
            param=prompt_param)
    room = context - num_prompt_tokens  # the context left after the prompt
    if max_tokens is not None and max_tokens > room:
        raise ContextLengthError(
            f"max_tokens is {max_tokens}, but only {room} tokens are left in this model's context "
            f"of {context} tokens after the prompt's {num_prompt_tokens}.", param="max_tokens")
    if max_tokens is not None and cap is not None and max_tokens > cap:
        raise InvalidRequestError(f"max_tokens is {max_tokens}, but this server generates at most {cap} "
                                  f"tokens per request.", param="max_tokens")
    if max_tokens is None:
        max_tokens = min(default_max_tokens or room, room, cap or room)
    vocab = services.llm.model_config.vocab_size
    if not all(token < vocab for token in body.stop_token_ids or ()):
        raise InvalidValueError(f"stop_token_ids must be in [0, {vocab})", param="stop_token_ids")
    top_k = body.top_k if body.top_k is not None and 0 < body.top_k < vocab else -1  # else: all
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=top_k,
        seed=None if body.seed is None else body.seed % 2**63, stop=body.stop or (),
        stop_token_ids=tuple(body.stop_token_ids or ()), logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, ignore_eos=bool(body.ignore_eos),
    )


async def generate(services: Services, job: Job) -> AsyncIterator[RequestOutput]:
    """The request's outputs (cumulative, as the engine gives them). Raises before the first
    output if it is refused (429 past the tenant's tokens per minute, unknown adapter, invalid
    for the engine). Closing the iterator early aborts the engine request."""
    num_prompt = len(job.prompt_token_ids)
    admission = job.admission
    try:
        admission.reserve(num_prompt + job.params.max_tokens)
    except RateLimitError:
        services.metrics.reject("rate_limit")
        raise
    metrics = services.metrics
    metrics.request_max_tokens.observe(job.params.max_tokens)
    last: RequestOutput | None = None
    previous_at = job.arrival
    try:
        async with aclosing(services.engine.generate(
                job.request_id, prompt_token_ids=job.prompt_token_ids, params=job.params,
                adapter=job.adapter.digest if job.adapter else None, tenant=job.tenant)) as outputs:
            async for output in outputs:
                now = time.monotonic()
                (metrics.time_to_first_token if last is None else metrics.inter_token_latency).observe(
                    now - previous_at)
                previous_at, last = now, output
                metrics.generation_tokens.inc(len(output.new_token_ids))
                if output.finish_reason == "error":  # the detail stays in the log
                    logger.error("request %s failed in the engine: %s", job.request_id, output.error)
                    raise EngineRequestError(f"the engine failed on this request (request id "
                                             f"{job.request_id})")
                yield output
    finally:
        num_completion = len(last.token_ids) if last is not None else 0
        admission.release(num_prompt + num_completion)
        if last is not None:
            services.usage.record(job.tenant, job.adapter.name if job.adapter else None, num_prompt,
                                  num_completion)
            if last.finished and last.finish_reason in ("stop", "length"):
                metrics.finished(job.tenant, last.finish_reason, num_prompt, num_completion)
                metrics.e2e_latency.observe(time.monotonic() - job.arrival)
            elif not last.finished:
                metrics.aborted.inc()


async def run_job(request: Request, services: Services, job: Job, *, stream: bool,
                  events: Callable[[RequestOutput, AsyncIterator[RequestOutput]], AsyncIterator[str]]
                  ) -> RequestOutput | Response:
    """Run the job for an HTTP request: with `stream`, a server-sent event response of
    `events(first output, the rest)`, sent once the first output exists (so a refusal is still
    an HTTP error); else the finished output. A client that leaves first stops the job (and gets
    a 499 that nobody reads)."""
    outputs = generate(services, job)
    try:
        first = await until_disconnect(request, first_output(outputs))
        if stream:
            return EventStreamResponse(events(first, outputs), outputs.aclose)
        return await until_disconnect(request, last_output(first, outputs))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        if not stream:
            await outputs.aclose()


async def first_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    output = await anext(outputs, None)
    if output is None:  # the engine never ends a request without an output
        raise EngineRequestError("the engine ended the request without output")
    return output


async def last_output(first: RequestOutput, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = first
    while not last.finished:
        output = await anext(outputs, None)
        if output is None:
            break
        last = output
    return last


def token_logprobs(output: RequestOutput, newest_only: bool) -> list[TokenLogprob]:
    """The output's token log-probabilities: all, or this step's. (The engine's list grows on
    its own thread; the output's token count says how far this output reaches.)"""
    end = len(output.token_ids)
    start = end - len(output.new_token_ids) if newest_only else 0
    return list((output.logprobs or [])[start:end])


def usage_of(output: RequestOutput) -> Usage:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def prompt_logprobs_of(services: Services, output: RequestOutput, num_top: int) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: for each prompt token after the first, its own entry and its
    `num_top` best alternatives, by token id."""
    entries = output.prompt_logprobs or []
    ids = [t for e in entries if e is not None for t in (e.token_id, *list(e.top)[:num_top])]
    texts = dict(zip(ids, await services.codec.token_texts(ids)))
    result: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        tops = list(entry.top.items())[:num_top]
        by_id = {str(t): PromptLogprob(logprob=lp, rank=rank, decoded_token=texts[t])
                 for rank, (t, lp) in enumerate(tops, start=1)}
        by_id[str(entry.token_id)] = PromptLogprob(logprob=entry.logprob, rank=entry.rank or 1,
                                                   decoded_token=texts[entry.token_id])
        result.append(by_id)
    return result

"""One generation request, whichever API it came through: the model it names, its sampling
parameters checked against the context and the server's caps, admission (server queue and the
tenant's limits), the engine stream (the engine is told the adapter's digest and the tenant),
and at the end the accounting (limits released, usage recorded, metrics) however the request ended."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import aclosing
from dataclasses import dataclass, replace

from fastapi import Request, Response

from loraplex.engine.blending import DocumentBlend
from loraplex.engine.grammar import CompiledGrammar
from loraplex.errors import ContextLengthError, DeviceOutOfMemoryError, InvalidRequestError, LoraplexError
from loraplex.registry.names import NAME_PATTERN
from loraplex.registry.records import AdapterRecord
from loraplex.registry.registry_errors import AdapterNotFoundError
from loraplex.server.http_errors import RateLimitError, ServiceUnavailableError
from loraplex.server.limits import Admission
from loraplex.server.schemas.openai import PromptLogprob, PromptLogprobs, SamplingFields, Usage
from loraplex.server.services import Services
from loraplex.server.streaming import ClientDisconnected, EventStreamResponse, until_disconnect
from loraplex.server.structured_outputs import structured_output
from loraplex.types import RequestOutput, SamplingParams, StreamingWindow, TokenLogprob

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
    n: int = 1
    """Choices (samples) of the prompt: engine requests that share the prompt's KV blocks."""
    grammar: CompiledGrammar | None = None
    """With `params.structured`: the compiled constraint (each choice gets its own matcher)."""
    documents: DocumentBlend | None = None
    """Where registered documents lie in the prompt, for the engine to blend their KV."""


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
    streaming = streaming_window(services, body)
    if num_prompt_tokens > services.max_prompt_tokens:  # (past the context only with the engine's sinks)
        raise ContextLengthError(
            f"This model's maximum context length is {context} tokens; the prompt has "
            f"{num_prompt_tokens} tokens (at most {services.max_prompt_tokens} are accepted).",
            param=prompt_param)
    room = context - num_prompt_tokens  # the context left after the prompt
    if streaming is not None:  # attention sinks: max_tokens may run past the context (by default
        room = max(room, context)  # a context's worth), only the server's cap bounds it
    if max_tokens is not None and max_tokens > room and streaming is None:
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
        structured=structured_output(body),
        streaming_window=None if body.streaming_window is None else streaming,
    )


def streaming_window(services: Services, body: SamplingFields) -> StreamingWindow | None:
    """The request's attention sinks (its own, else the engine's), checked against the cache."""
    window = services.llm.streaming_window
    if body.streaming_window is not None:
        window = StreamingWindow(body.streaming_window.sliding_window, body.streaming_window.attention_sinks)
    if window is not None and (problem := services.llm.window_problem(window)) is not None:
        raise InvalidValueError(problem, param=window.param)
    return window


async def compile_constraint(services: Services, params: SamplingParams) -> CompiledGrammar | None:
    """The request's compiled output constraint (None without one): 400 naming its field if it
    cannot compile in time."""
    if params.structured is None:
        return None
    return await services.grammars.compile(params.structured)


Choice = tuple[int, RequestOutput]
"""A choice's index and its latest output (cumulative, as the engine gives them)."""


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of choice `index`: a given seed advances by the index (choices of one
    seeded request differ and are each reproducible); only the first scores the prompt."""
    if index == 0:
        return params
    return replace(params, seed=None if params.seed is None else (params.seed + index) % 2**63,
                   prompt_logprobs=None)


async def generate(services: Services, job: Job) -> AsyncIterator[Choice]:
    """The job's outputs, choice by choice as they come. Raises before the first output if it
    is refused (429 past the tenant's tokens per minute, unknown adapter, invalid for the
    engine). Closing the iterator early aborts every choice's engine request."""
    num_prompt = len(job.prompt_token_ids)
    admission = job.admission
    try:
        admission.reserve(num_prompt + job.n * job.params.max_tokens)
    except RateLimitError:
        services.metrics.reject("rate_limit")
        raise
    metrics = services.metrics
    metrics.request_max_tokens.observe(job.params.max_tokens)
    if job.adapter is not None:
        metrics.lora_requests.inc(job.n)
    last: dict[int, RequestOutput] = {}
    previous_at: dict[int, float] = {}
    try:
        async with aclosing(_choices(services, job)) as choices:
            async for index, output in choices:
                now = time.monotonic()
                if not last:
                    metrics.time_to_first_token.observe(now - job.arrival)
                elif index in previous_at:
                    metrics.inter_token_latency.observe(now - previous_at[index])
                previous_at[index], last[index] = now, output
                metrics.generation_tokens.inc(len(output.new_token_ids))
                if output.finish_reason == "error":  # the detail stays in the log
                    logger.error("request %s failed in the engine: %s", job.request_id, output.error)
                    if output.error_code == DeviceOutOfMemoryError.code:
                        raise ServiceUnavailableError(
                            f"the engine ran out of device memory in a step of this request (request "
                            f"id {job.request_id}); other requests go on: retry, or send a shorter "
                            "prompt", retry_after_s=services.config.retry_after_s,
                            code=DeviceOutOfMemoryError.code)
                    raise EngineRequestError(f"the engine failed on this request (request id "
                                             f"{job.request_id})")
                yield index, output
    finally:
        num_completion = sum(len(output.token_ids) for output in last.values())
        admission.release(num_prompt + num_completion)
        if last:
            services.usage.record(job.tenant, job.adapter.name if job.adapter else None, num_prompt,
                                  num_completion)
            done = len(last) == job.n and all(o.finished for o in last.values())
            if done and all(o.finish_reason in ("stop", "length") for o in last.values()):
                for output in last.values():
                    metrics.finished(job.tenant, output.finish_reason, num_prompt, len(output.token_ids))
                metrics.e2e_latency.observe(time.monotonic() - job.arrival)
            elif not done:
                metrics.aborted.inc()


async def _choices(services: Services, job: Job) -> AsyncIterator[Choice]:
    """Every choice's engine stream, merged as outputs arrive. Choice 0 is the engine request
    `job.request_id`; choice i the request `<id>.i`, a sample of the first (sharing its prompt
    blocks)."""
    adapter = job.adapter.digest if job.adapter else None

    def stream(index: int, sample_of: str | None = None) -> AsyncIterator[RequestOutput]:
        request_id = job.request_id if index == 0 else f"{job.request_id}.{index}"
        return services.engine.generate(
            request_id, prompt_token_ids=job.prompt_token_ids, params=sample_params(job.params, index),
            adapter=adapter, tenant=job.tenant, sample_of=sample_of, grammar=job.grammar,
            documents=job.documents if sample_of is None else None)

    if job.n == 1:
        async with aclosing(stream(0)) as outputs:
            async for output in outputs:
                yield 0, output
        return
    merged: asyncio.Queue[Choice | BaseException | None] = asyncio.Queue()

    async def pump(index: int, outputs: AsyncIterator[RequestOutput], first: RequestOutput | None) -> None:
        try:
            async with aclosing(outputs):
                if first is not None:
                    await merged.put((index, first))
                async for output in outputs:
                    await merged.put((index, output))
            await merged.put(None)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await merged.put(exc)

    # The first choice's request is queued (and its refusals raised) before its samples'.
    streams = [stream(0)]
    pumps: list[asyncio.Task] = []
    try:
        first = await anext(streams[0])
        donor = None if first.finished else job.request_id  # a finished request shares nothing
        streams += [stream(i, donor) for i in range(1, job.n)]
        pumps = [asyncio.create_task(pump(i, s, first if i == 0 else None)) for i, s in enumerate(streams)]
        for _ in range(job.n):
            while (item := await merged.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        if not pumps:
            await streams[0].aclose()


async def run_job(request: Request, services: Services, job: Job, *, stream: bool,
                  events: Callable[[Choice, AsyncIterator[Choice]], AsyncIterator[str]]
                  ) -> list[RequestOutput] | Response:
    """Run the job for an HTTP request: with `stream`, a server-sent event response of
    `events(first choice output, the rest)`, sent once the first output exists (so a refusal is
    still an HTTP error); else each choice's finished output, by index. A client that leaves
    first stops the job (and gets a 499 that nobody reads)."""
    outputs = generate(services, job)
    try:
        first = await until_disconnect(request, first_output(outputs))
        if stream:
            return EventStreamResponse(events(first, outputs), outputs.aclose)
        return await until_disconnect(request, last_outputs(job.n, first, outputs))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        if not stream:
            await outputs.aclose()


async def first_output(outputs: AsyncIterator[Choice]) -> Choice:
    choice = await anext(outputs, None)
    if choice is None:  # the engine never ends a request without an output
        raise EngineRequestError("the engine ended the request without output")
    return choice


async def last_outputs(n: int, first: Choice, outputs: AsyncIterator[Choice]) -> list[RequestOutput]:
    """Each choice's final output, by index."""
    last = dict([first])
    async for index, output in outputs:
        last[index] = output
    if len(last) < n:
        raise EngineRequestError("the engine ended a choice without output")
    return [last[i] for i in range(n)]


def token_logprobs(output: RequestOutput, newest_only: bool) -> list[TokenLogprob]:
    """The output's token log-probabilities: all, or this step's. (The engine's list grows on
    its own thread; the output's token count says how far this output reaches.)"""
    end = len(output.token_ids)
    start = end - len(output.new_token_ids) if newest_only else 0
    return list((output.logprobs or [])[start:end])


def usage_of(outputs: list[RequestOutput]) -> Usage:
    """The usage of a job's choices: the prompt once, every choice's completion."""
    return Usage(**usage_counts(len(outputs[0].prompt_token_ids), outputs))


def usage_counts(num_prompt_tokens: int, outputs: Iterable[RequestOutput]) -> dict[str, int]:
    """`usage_of` as a plain dict (a stream sends one with every chunk)."""
    completion = sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": num_prompt_tokens + completion}


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

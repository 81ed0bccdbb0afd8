"""POST /v1/chat/completions: the messages through the model's chat template."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import APIRouter, Request, Response

from loraplex.errors import InvalidRequestError
from loraplex.server.admission import AdmissionDep
from loraplex.server.auth import TenantDep
from loraplex.server.deps import ServicesDep
from loraplex.server.documents import document_blend, requested_documents, with_documents
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
from loraplex.server.routes.completions import FINGERPRINT, STREAM_RESPONSE
from loraplex.server.routes.docs import INFERENCE_ERRORS
from loraplex.server.schemas.openai import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatLogprobs,
    TokenLogprob,
    TopLogprob,
)
from loraplex.server.services import Services
from loraplex.server.streaming import DONE, ChunkEvents, sse
from loraplex.server.system_prompts import find_system_prompt, pin_system_prompt, reject_own_system_message
from loraplex.server.tools import (
    ToolCallStream,
    ToolMode,
    chat_messages,
    may_become_call,
    parse_tool_calls,
    template_takes_tools,
    tool_constraint,
    tool_mode,
)
from loraplex.types import RequestOutput

router = APIRouter(prefix="/v1", tags=["OpenAI API"])


@router.post("/chat/completions", response_model=ChatCompletion, summary="Answer a conversation",
             responses={**INFERENCE_ERRORS, 200: STREAM_RESPONSE})
async def create_chat_completion(body: ChatCompletionRequest, principal: TenantDep,
                                 services: ServicesDep, request: Request,
                                 admission: AdmissionDep) -> ChatCompletion | Response:
    """The assistant's next message after `messages`, rendered with the model's chat template,
    from the base model or one of your adapters (`model`). With `stream: true` the answer
    comes as server-sent events; leaving the stream stops the generation."""
    arrival = time.monotonic()
    adapter = await resolve_model(services, principal.tenant, body.model)
    tools = tool_mode(body)
    messages, tool_list = chat_messages(body, template_takes_tools(services.codec.chat_template))
    documents = await requested_documents(services, principal.tenant, body)
    if documents:
        messages = with_documents(messages, documents)
    if body.system_prompt is not None:
        record = await find_system_prompt(services, principal.tenant, body.system_prompt, adapter)
        reject_own_system_message(["system" if m.role == "developer" else m.role for m in body.messages])
        system = {"role": "system", "content": record.text}
        messages = [system, *messages]
        system_ids = await services.codec.encode_chat([system], principal.tenant)
        await pin_system_prompt(services, record, system_ids, "chat")
    prompt_ids = truncated(body, await services.codec.encode_chat(messages, principal.tenant, tool_list))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(services, body, len(prompt_ids), max_tokens=max_tokens,
                             default_max_tokens=None, logprobs=logprobs, prompt_param="messages",
                             prompt_logprobs=body.prompt_logprobs)
    if (calls := tool_constraint(body, tools)) is not None:
        if params.structured is not None:
            raise InvalidRequestError(f"tool_choice constrains the output, and so does "
                                  f"{params.structured.param}: give one", param="tool_choice")
        params = replace(params, structured=calls)
    job = Job(request_id_of(request.scope), principal.tenant, body.model, adapter, prompt_ids, params,
              arrival, admission, n=body.n or 1, grammar=await compile_constraint(services, params),
              documents=await document_blend(services, principal.tenant, body, prompt_ids, documents))
    outputs = await run_job(request, services, job, stream=bool(body.stream),
                            events=lambda first, rest: _events(services, job, body, tools, first, rest))
    if isinstance(outputs, Response):
        return outputs
    choices = [ChatChoice(index=i, **_answer(tools, output),
                          logprobs=await _logprobs(services, output, body, newest_only=False))
               for i, output in enumerate(outputs)]
    return ChatCompletion(
        id=f"chatcmpl-{job.request_id}", created=int(time.time()), model=job.model,
        system_fingerprint=FINGERPRINT, choices=choices, usage=usage_of(outputs),
        prompt_logprobs=None if body.prompt_logprobs is None else await prompt_logprobs_of(
            services, outputs[0], body.prompt_logprobs),
    )


def _answer(tools: ToolMode | None, output: RequestOutput) -> dict:
    """The message and finish reason of a finished choice: its tool calls, if it made any."""
    calls = None
    if tools is not None and output.finish_reason == "stop":
        calls = parse_tool_calls(tools, output.text)
    if calls:
        return {"message": AssistantMessage(content=None, tool_calls=calls), "finish_reason": "tool_calls"}
    return {"message": AssistantMessage(content=output.text), "finish_reason": output.finish_reason}


class _ChoiceDeltas:
    """One streamed choice's deltas: content, or tool calls (see loraplex/server/tools.py)."""

    def __init__(self, tools: ToolMode | None) -> None:
        self.tools = tools
        self.calls = ToolCallStream(tools) if tools is not None and tools.is_constrained else None
        self.held: str | None = "" if tools is not None and tools.kind == "auto" else None
        """An `auto` answer's text held back while it may still be a call (None: text)."""
        self.num_calls = 0

    def push(self, new_text: str, finished: bool) -> list[dict]:
        if self.calls is not None:
            deltas = self.calls.push(new_text)
            self.num_calls = self.calls.num_calls
            return [{"tool_calls": [d.model_dump(exclude_none=True) for d in deltas]}] if deltas else []
        if self.held is None:
            return [{"content": new_text}] if new_text else []
        self.held += new_text
        if finished:
            text, self.held = self.held, None
            calls = parse_tool_calls(self.tools, text)
            if calls:
                self.num_calls = len(calls)
                return [{"tool_calls": [{"index": i, **call.model_dump()} for i, call in enumerate(calls)]}]
            return [{"content": text}] if text else []
        if may_become_call(self.held):
            return []
        text, self.held = self.held, None
        return [{"content": text}]

    def finish_reason(self, output: RequestOutput) -> str | None:
        return "tool_calls" if self.num_calls and output.finish_reason == "stop" else output.finish_reason


async def _events(services: Services, job: Job, body: ChatCompletionRequest, tools: ToolMode | None,
                  first: Choice, rest: AsyncIterator[Choice]) -> AsyncIterator[str]:
    events = ChunkEvents({"id": f"chatcmpl-{job.request_id}", "object": "chat.completion.chunk",
                          "created": int(time.time()), "model": job.model, "system_fingerprint": FINGERPRINT})
    num_prompt = len(first[1].prompt_token_ids)
    latest: dict[int, RequestOutput] = {}  # each choice's latest output: the usage so far counts all
    include_usage, continuous_usage = body.include_usage, body.continuous_usage  # read once

    def chunk(index: int, delta: dict, finish_reason: str | None = None,
              logprobs: ChatLogprobs | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs.model_dump() if logprobs else None,
                  "finish_reason": finish_reason}
        if not include_usage:
            return events.event([choice])
        usage = usage_counts(num_prompt, latest.values()) if continuous_usage else None
        return events.event([choice], usage)

    for index in range(job.n):
        yield chunk(index, {"role": "assistant", "content": ""})
    deltas = [_ChoiceDeltas(tools) for _ in range(job.n)]
    try:
        choice: Choice | None = first
        while choice is not None:
            index, output = choice
            latest[index] = output
            if body.logprobs and tools is None:
                logprobs = await _logprobs(services, output, body, newest_only=True)
                yield chunk(index, {"content": output.new_text}, logprobs=logprobs)
            else:
                for delta in deltas[index].push(output.new_text, output.finished):
                    yield chunk(index, delta)
            if output.finished:
                yield chunk(index, {}, deltas[index].finish_reason(output))
            choice = await anext(rest, None)
        if body.include_usage:
            yield events.event([], usage_counts(num_prompt, latest.values()))
    except Exception as exc:  # after the stream began: an error event, then the end
        yield sse(stream_error(exc, job.request_id))
    yield DONE


async def _logprobs(services: Services, output: RequestOutput, body: ChatCompletionRequest, *,
                    newest_only: bool) -> ChatLogprobs | None:
    if not body.logprobs:
        return None
    entries = token_logprobs(output, newest_only)
    texts = iter(await services.codec.token_texts(
        [t for e in entries for t in (e.token_id, *e.top)]))
    content = []
    for entry in entries:
        token = next(texts)
        top = [TopLogprob(token=text, logprob=lp, bytes=list(text.encode()))
               for lp, text in zip(entry.top.values(), texts)]
        content.append(TokenLogprob(token=token, logprob=entry.logprob, bytes=list(token.encode()),
                                    top_logprobs=top))
    return ChatLogprobs(content=content)

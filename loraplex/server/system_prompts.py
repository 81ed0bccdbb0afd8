"""Registered system prompts named in a request (`system_prompt`, through the openai client's
`extra_body`): the tenant's own prompt only (another tenant's name is unknown: 404), with its
bound adapter only (400 otherwise). The server puts its text first and has the engine pin its
KV blocks, keyed by prompt row and API (completions put the text before the prompt, chat makes
it the system message: their tokens differ), so every request naming it reads the same cached
blocks; a request that sends the same text itself finds the same blocks. A prompt is prefilled
and pinned in both forms when it is registered and when the server starts (`warm_system_prompt`),
so that its first request already finds it warm."""

from __future__ import annotations

import hashlib
import json
import logging
from functools import partial

from starlette.concurrency import run_in_threadpool

from loraplex.engine.llm_engine import LLMEngine
from loraplex.errors import InvalidRequestError, LoraplexError
from loraplex.registry.records import AdapterRecord, SystemPromptRecord
from loraplex.server.services import Services

logger = logging.getLogger(__name__)


async def find_system_prompt(services: Services, tenant: str, name: str,
                             adapter: AdapterRecord | None) -> SystemPromptRecord:
    """The tenant's prompt `name` (NotFoundError: 404), checked against the request's adapter."""
    record = await run_in_threadpool(services.registry.prompts.get, tenant, name)
    if record.adapter_digest is not None and (adapter is None or adapter.digest != record.adapter_digest):
        raise InvalidRequestError(f"system prompt {name!r} is bound to adapter {record.adapter!r}; "
                                  "name that adapter as the model", param="system_prompt")
    return record


def _pin_row(record: SystemPromptRecord) -> str:
    """The start of the keys of a prompt row's pins (one per API form, adapter and text)."""
    return f"{record.tenant}/{record.name}/{record.id}/"


def prompt_use(pinned: dict[str, tuple[int, int]], record: SystemPromptRecord) -> tuple[int, int]:
    """(KV blocks the engine holds for the prompt, running requests reading them), from the
    engine's pin figures (EngineStats.pinned_prompts)."""
    row = _pin_row(record)
    uses = [use for key, use in pinned.items() if key.startswith(row)]
    return sum(blocks for blocks, _ in uses), sum(users for _, users in uses)


async def pin_system_prompt(services: Services, record: SystemPromptRecord, token_ids: list[int],
                            api: str) -> None:
    """Have the engine prefill and hold the prompt's KV (once per prompt row, API, adapter and
    tokens)."""
    tokens = hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:16]  # a changed text: a new pin
    name, row = f"{record.tenant}/{record.name}/", _pin_row(record)
    same_api = f"{row}{api}/{record.adapter_digest or ''}/"
    key = f"{same_api}{tokens}"

    await services.engine.call(partial(_pin, key=key, token_ids=token_ids, name=name, row=row,
                                       same_api=same_api, tenant=record.tenant,
                                       adapter=record.adapter_digest))


def _pin(engine: LLMEngine, *, key: str, token_ids: list[int], name: str, row: str, same_api: str,
         tenant: str, adapter: str | None) -> None:
    """In the engine (its thread or its process): pin `key`, unpinning the prompt's older pins."""
    for old in engine.pinned_prompts():  # the prompt of that name replaced since (a row id may recur)
        if old.startswith(name) and (not old.startswith(row) or old.startswith(same_api) and old != key):
            engine.unpin_prompt(old)
    engine.pin_prompt(key, token_ids, tenant=tenant, adapter=adapter)


async def warm_system_prompt(services: Services, record: SystemPromptRecord) -> None:
    """Prefill and pin a registered prompt as requests will send it: completions put its text,
    with the tokenizer's special tokens, before theirs; chat makes it the system message. A form
    that cannot be pinned now (no chat template, no room beside the other pins, its adapter
    cannot load) is logged and tried again by the first request that names the prompt."""
    system = [{"role": "system", "content": record.text}]
    forms = (("completions", lambda: services.codec.encode(record.text, record.tenant)),
             ("chat", lambda: services.codec.encode_chat(system, record.tenant)))
    for api, encode in forms:
        if api == "chat" and not services.codec.has_chat_template:
            continue
        try:
            await pin_system_prompt(services, record, await encode(), api)
        except LoraplexError as error:
            logger.warning("system prompt %s/%s (%s) is not pinned yet: %s",
                           record.tenant, record.name, api, error)


async def warm_system_prompts(services: Services) -> None:
    """Every registered prompt, warmed (at server start)."""
    for record in await run_in_threadpool(services.registry.prompts.list, None):
        await warm_system_prompt(services, record)


async def unpin_system_prompts(services: Services, tenant: str, name: str | None = None) -> None:
    """Let the engine's pins of a tenant's prompt `name` (every prompt of the tenant without
    one) go, once it is deleted."""
    prefix = f"{tenant}/{name}/" if name is not None else f"{tenant}/"
    await services.engine.call(partial(_unpin, prefix=prefix))


def _unpin(engine: LLMEngine, *, prefix: str) -> None:
    for key in engine.pinned_prompts():
        if key.startswith(prefix):
            engine.unpin_prompt(key)


def reject_own_system_message(roles: list[str]) -> None:
    if any(role in ("system", "developer") for role in roles):
        raise InvalidRequestError("a request naming a registered system_prompt cannot bring its own "
                                  "system message", param="system_prompt")

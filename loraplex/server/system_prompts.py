"""Registered system prompts named in a request (`system_prompt`, through the openai client's
`extra_body`): the tenant's own prompt only (another tenant's name is unknown: 404), with its
bound adapter only (400 otherwise). The server puts its text first and has the engine pin its
KV blocks, keyed by prompt row and API (completions put the text before the prompt, chat makes
it the system message: their tokens differ), so every request naming it reads the same cached
blocks; a request that sends the same text itself finds the same blocks."""

from __future__ import annotations

import hashlib
import json

from starlette.concurrency import run_in_threadpool

from loraplex.errors import InvalidRequestError
from loraplex.registry.records import AdapterRecord, SystemPromptRecord
from loraplex.server.services import Services


async def find_system_prompt(services: Services, tenant: str, name: str,
                             adapter: AdapterRecord | None) -> SystemPromptRecord:
    """The tenant's prompt `name` (NotFoundError: 404), checked against the request's adapter."""
    record = await run_in_threadpool(services.registry.prompts.get, tenant, name)
    if record.adapter_digest is not None and (adapter is None or adapter.digest != record.adapter_digest):
        raise InvalidRequestError(f"system prompt {name!r} is bound to adapter {record.adapter!r}; "
                                  "name that adapter as the model", param="system_prompt")
    return record


async def pin_system_prompt(services: Services, record: SystemPromptRecord, token_ids: list[int],
                            api: str) -> None:
    """Have the engine prefill and hold the prompt's KV (once per prompt row, API, adapter and
    tokens)."""
    tokens = hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:16]  # a changed text: a new pin
    key = f"{record.tenant}/{record.name}/{record.id}/{api}/{record.adapter_digest or ''}/{tokens}"
    await services.engine.call(lambda engine: engine.pin_prompt(
        key, token_ids, tenant=record.tenant, adapter=record.adapter_digest))


def reject_own_system_message(roles: list[str]) -> None:
    if any(role in ("system", "developer") for role in roles):
        raise InvalidRequestError("a request naming a registered system_prompt cannot bring its own "
                                  "system message", param="system_prompt")

"""An offline batch run to the end on one engine: `LLM.generate` and the offline benchmarks.

With `group_prefixes` (the default), the prompts go in in the prefix-tree order of the whole
batch (loraplex/engine/prefix_groups.py): each shared prefix, registered or not, is computed
once by its group's first member and the group runs together, so the shared KV lives briefly
and its members decode as one relay group. A group enters the engine's queue once the engine
has running places free for all of it (or for as many as it runs at once), or when the engine
would run short of work (nothing waiting, half its places free): a later group's first member
is not admitted, and its prefix held, long before the rest of its group can run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.prefix_groups import PrefixGroup, PromptKey, group_by_prefix
from loraplex.engine.tenants import DEFAULT_TENANT
from loraplex.types import RequestOutput, SamplingParams


@dataclass(frozen=True)
class BatchRequest:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    """A name the engine knows (or None: the base model)."""
    tenant: str | None = None


def prefix_groups(engine: LLMEngine, requests: Sequence[BatchRequest]) -> list[PrefixGroup]:
    """The batch's prefix groups, in submission order."""
    digests = _digests(engine, requests)
    keys = [PromptKey(r.tenant or DEFAULT_TENANT, digests.get(r.adapter), r.token_ids) for r in requests]
    return group_by_prefix(keys, engine.config.cache.block_size)


def _digests(engine: LLMEngine, requests: Sequence[BatchRequest]) -> dict[str, str]:
    """Adapter name -> digest, for every adapter the batch names (UnknownAdapterError first)."""
    return {name: engine.adapter_digest(name) for name in {r.adapter for r in requests} if name}


def run_batch(engine: LLMEngine, requests: Sequence[BatchRequest], *, group_prefixes: bool = True
              ) -> list[RequestOutput]:
    """Run `requests` to the end; one final output per request, in the order given. On an error
    every request of the batch still in the engine is aborted."""
    if group_prefixes:  # (either way, every adapter name is checked before anything runs)
        units = [group.members for group in prefix_groups(engine, requests)]
    else:
        _digests(engine, requests)
        units = [(i,) for i in range(len(requests))]
    final: dict[str, RequestOutput] = {}
    added: list[str] = []
    next_unit = 0
    try:
        while len(final) < len(requests):
            while next_unit < len(units) and _has_room(engine, len(units[next_unit])):
                for index in units[next_unit]:
                    request = requests[index]
                    engine.add_request(request.request_id, prompt_token_ids=request.token_ids,
                                       params=request.params, adapter=request.adapter, tenant=request.tenant)
                    added.append(request.request_id)
                next_unit += 1
            for output in engine.step():
                if output.finished:
                    final[output.request_id] = output
            if (next_unit == len(units) and not engine.has_unfinished_requests()
                    and len(final) < len(requests)):
                raise RuntimeError("the engine stopped with requests unfinished")
        return [final[r.request_id] for r in requests]
    finally:
        for request_id in added:
            engine.abort(request_id)  # no-op for finished ones; frees all on error


def _has_room(engine: LLMEngine, group_size: int) -> bool:
    """Whether a group of `group_size` requests goes into the queue now."""
    max_running = engine.config.scheduler.max_num_seqs
    num_waiting, num_running = engine.scheduler.num_waiting, len(engine.scheduler.running)
    num_free = max_running - num_running - num_waiting
    return num_free >= min(group_size, max_running) or (num_waiting == 0 and 2 * num_running <= max_running)

"""The offline API:

    from loraplex import LLM, SamplingParams
    llm = LLM("path/to/hf-model-folder", device="cpu", dtype="float32")
    llm.add_adapter("support-bot", "path/to/peft-adapter-folder")
    outs = llm.generate(["Hello", "Hi"], SamplingParams(max_tokens=32, temperature=0.0),
                        adapters=["support-bot", None], tenants=["acme", "globex"])
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loraplex.engine.disaggregated import DisaggregatedEngine
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.offline_batch import BatchRequest, run_batch
from loraplex.engine_config import ConfigError, EngineConfig
from loraplex.errors import InvalidRequestError
from loraplex.types import RequestOutput, SamplingParams


class LLM:
    """Generate from a batch of prompts, each with its own adapter and tenant, all scheduled
    together. Keyword arguments are engine options (`max_loras`, `block_size`,
    `max_num_batched_tokens`, `tensor_parallel_size`, ...: the fields of
    loraplex.engine_config, the same as `loraplex serve`'s flags). With tensor_parallel_size > 1
    the model runs in that many spawned worker processes: a script that makes one needs an
    `if __name__ == "__main__":` guard. `disaggregate="1:1"` prefills each request on one engine
    core and decodes it on another, each on its own KV pool and its own worker process (on CUDA
    GPUs 0 and 1) and stepping on its own thread, the decode side's worker copying the KV blocks
    out of the prefill side's (loraplex/engine/disaggregated.py);
    `disaggregate_processes=False` runs both sides' model in this process instead (CPU)."""

    def __init__(
        self, model: str | Path, *, device: str = "auto", dtype: str = "auto",
        disaggregate: str | None = None, disaggregate_processes: bool = True, **options: Any
    ) -> None:
        config = EngineConfig.from_kwargs(str(model), device=device, dtype=dtype, **options)
        if disaggregate is None:
            self.engine: LLMEngine | DisaggregatedEngine = LLMEngine(config)
        elif disaggregate == "1:1":
            self.engine = DisaggregatedEngine(config, processes=disaggregate_processes, concurrent=True)
        else:
            raise ConfigError("disaggregate", f"{disaggregate!r}: one prefill and one decode side, \"1:1\", "
                              "is what is built")
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's threads and, with tensor_parallel_size > 1, its worker processes
        (they also stop when this process exits)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def add_adapter(self, name: str, path: str | Path) -> str:
        """Load a PEFT adapter folder under `name`; returns its digest."""
        return self.engine.add_adapter(name, path)

    def remove_adapter(self, name: str) -> None:
        self.engine.remove_adapter(name)

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """A tenant's share under contention (default 1), used from the next step on."""
        self.engine.set_tenant_weight(tenant, weight)

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        adapters: str | None | Sequence[str | None] = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        tenants: str | None | Sequence[str | None] = None,
        group_prefixes: bool = True,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. `sampling_params`, `adapters` and `tenants` are one
        for all prompts or one per prompt (None: the default tenant). With `group_prefixes`,
        prompts that start alike (same tenant and adapter) are scheduled together, their common
        prefix computed once (loraplex/engine/offline_batch.py); off, they go in in order."""
        if (prompts is None) == (prompt_token_ids is None):
            raise InvalidRequestError("give exactly one of prompts and prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        count = len(prompts) if prompts is not None else len(prompt_token_ids)
        params = _per_prompt(sampling_params or SamplingParams(), count, "sampling_params")
        names = _per_prompt(adapters, count, "adapters")
        tenant_of = _per_prompt(tenants, count, "tenants")
        texts = prompts if prompts is not None else [None] * count
        ids = prompt_token_ids if prompt_token_ids is not None else [None] * count
        requests = [BatchRequest(request_id=f"offline-{next(self._ids)}",
                                 token_ids=self.engine.encode_prompt(texts[i], ids[i]), params=params[i],
                                 adapter=names[i], tenant=tenant_of[i]) for i in range(count)]
        return run_batch(self.engine, requests, group_prefixes=group_prefixes)


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    if value is None or isinstance(value, (str, SamplingParams)):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise InvalidRequestError(f"{name} has {len(values)} entries for {count} prompts", param=name)
    return values

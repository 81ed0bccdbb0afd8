"""Disaggregated prefill and decode (DistServe): two engine cores, each an LLMEngine on its own
KV pool (its own block manager, scheduler, adapter cache and tenant counters), each side's model
in a worker process of its own (`processes`; docs/disaggregated.md), or both sharing one model
object in this process.

A request is prefilled on the prefill side under its adapter: its prompt computed and its first
token sampled (`add_request(..., prefill_only=True)`); it then leaves that engine holding its
prompt's blocks (`take_prefilled`) and joins the decode side's queue as a swapped request does
(`admit_prefilled`), its KV still on the prefill side. When the decode side admits it (its
adapter in a slot there, through the same lifecycle; room in its KV pool), the KV of the prompt
blocks that the decode side has not cached is copied into the blocks it allocated
(`copy_kv_blocks`, the one place where KV crosses; between worker processes the prefill side's
worker sends them and the decode side's receives them), the prefill side frees its references
(its prefix cache and pinned
prompts keep theirs), and the request decodes from its first token with the same sampling state
(seed and token index). Until then it is between the sides: aborting it frees the prefill
side's blocks. The decode side schedules, preempts (swap or recompute, on its own pool), groups
relay decodes and keeps VTC counters as a colocated engine does; the prompt is charged once,
on the prefill side.

A registered system prompt is pinned on the prefill side (computed there) and its blocks are
sent once to the decode side, which holds them too: requests that start with it find them
cached there and receive only the rest. Requests with attention sinks run whole on the decode
side; requests that only score their prompt, whole on the prefill side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from loraplex.adapter_format import LoraAdapter
from loraplex.engine.adapter_cache import AdapterLoader
from loraplex.engine.handoff import PrefilledRequest
from loraplex.engine.kv_swap import runs
from loraplex.engine.llm_engine import LLMEngine, PinnedPrompt
from loraplex.engine.lora_weights import HostAdapter
from loraplex.engine.request import Request
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.sizing import resolve_device
from loraplex.engine_config import ConfigError, EngineConfig
from loraplex.errors import InvalidRequestError, LoraplexError
from loraplex.model.llama import LlamaForCausalLM
from loraplex.types import RequestOutput, SamplingParams


def copy_kv_blocks(source: torch.Tensor, source_ids: list[int], target: torch.Tensor,
                   target_ids: list[int]) -> None:
    """Copy KV blocks from `source` to `target`, both [num_blocks, layers, 2, block_size,
    kv_heads, head_dim] of one dtype: block `source_ids[i]` into block `target_ids[i]` (each run
    of adjacent ids on both sides in one copy)."""
    if len(source_ids) != len(target_ids):
        raise ValueError(f"{len(source_ids)} source blocks for {len(target_ids)} target blocks")
    if source.shape[1:] != target.shape[1:] or source.dtype != target.dtype:
        raise ValueError(f"KV blocks of {tuple(source.shape[1:])} {source.dtype} cannot be copied into "
                         f"blocks of {tuple(target.shape[1:])} {target.dtype}")
    for first, into, count in runs(list(zip(source_ids, target_ids))):
        target[into:into + count].copy_(source[first:first + count])


class DisaggregatedEngine:
    """A prefill engine and a decode engine behind LLMEngine's interface (the parts the offline
    LLM and tests drive). Single-threaded: one caller at a time."""

    def __init__(self, config: EngineConfig, decode_config: EngineConfig | None = None,
                 model: LlamaForCausalLM | None = None, processes: bool = False) -> None:
        """The prefill side from `config` (the model folder `config.model`, or `model`), the
        decode side from `decode_config` (default: `config`). With `processes`, each side's model
        runs in a worker process of its own (on CUDA the prefill side on GPU 0, the decode side
        on GPU 1), the two in one torch.distributed group (gloo on CPU, NCCL on GPUs) that
        carries the KV blocks; without, both sides share one model object in this process (CPU
        only)."""
        decode_config = decode_config or config
        if config.tensor_parallel_size > 1 or decode_config.tensor_parallel_size > 1:
            raise ConfigError("disaggregate", "each side runs on one device: tensor_parallel_size must be 1")
        if config.cache.block_size != decode_config.cache.block_size:
            raise ConfigError("block_size", "the prefill and decode sides need the same block size")
        self._workers = None
        if processes:
            self.prefill, self.decode = self._start_workers(config, decode_config, model)
        else:
            self.prefill = LLMEngine(config, model=model)
            if self.prefill.device.type != "cpu":
                self.prefill.close()
                raise ConfigError("disaggregate", "in one process, prefill and decode sides run on CPU only")
            self.decode = LLMEngine(decode_config, model=self.prefill.model, tokenizer=self.prefill.tokenizer)
        self.decode.receive_kv = self._receive
        self._transit: dict[str, PrefilledRequest] = {}
        """Requests in the decode side's queue whose KV is still on the prefill side."""
        self._pins_to_send: set[str] = set()
        self.num_blocks_sent = 0
        """KV blocks copied from the prefill side to the decode side."""
        self.num_blocks_reused = 0
        """Prompt blocks a request did not need sent: the decode side had them cached."""

    def _start_workers(self, config: EngineConfig, decode_config: EngineConfig,
                       model: LlamaForCausalLM | None) -> tuple[LLMEngine, LLMEngine]:
        from loraplex.worker.workers import spawn_disaggregated  # (the worker side imports the engine)

        if model is not None:
            raise ConfigError("disaggregate", "with worker processes each loads the model folder: "
                              "pass no model")
        device = resolve_device(config.device)
        if resolve_device(decode_config.device) != device:
            raise ConfigError("device", "the prefill and decode sides need the same kind of device")
        (prefill_workers,), (decode_workers,) = spawn_disaggregated(
            1, 1, backend="nccl" if device.type == "cuda" else "gloo",
            num_threads=torch.get_num_threads() if device.type == "cuda" else 1)
        self._workers = prefill_workers, decode_workers
        try:
            prefill = LLMEngine(config, workers=prefill_workers)
            try:
                decode = LLMEngine(decode_config, workers=decode_workers, tokenizer=prefill.tokenizer)
            except BaseException:
                prefill.close()
                raise
        except BaseException:
            prefill_workers.close()
            decode_workers.close()
            raise
        return prefill, decode

    # What the offline LLM reads -------------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        """The prefill side's config (where requests are admitted first)."""
        return self.prefill.config

    @property
    def scheduler(self) -> Scheduler:
        """The prefill side's scheduler (where requests are admitted first)."""
        return self.prefill.scheduler

    @property
    def tokenizer(self) -> Any:
        return self.prefill.tokenizer

    def encode_prompt(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        return self.prefill.encode_prompt(prompt, prompt_token_ids)

    # Adapters and tenants: on both sides ----------------------------------------------------
    def add_adapter(self, name: str, source: str | Path | LoraAdapter | HostAdapter) -> str:
        """Make an adapter servable under `name` on both sides; returns its digest."""
        digest = self.prefill.add_adapter(name, source)
        self.decode.add_adapter(name, source)
        return digest

    def remove_adapter(self, name: str) -> None:
        self.prefill.remove_adapter(name)
        self.decode.remove_adapter(name)

    def set_adapter_loader(self, loader: AdapterLoader) -> None:
        self.prefill.set_adapter_loader(loader)
        self.decode.set_adapter_loader(loader)

    def adapter_digest(self, adapter: str) -> str:
        return self.prefill.adapter_digest(adapter)

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        self.prefill.set_tenant_weight(tenant, weight)
        self.decode.set_tenant_weight(tenant, weight)

    # Registered system prompts ------------------------------------------------------------
    def pin_prompt(self, key: str, token_ids: list[int], tenant: str | None = None,
                   adapter: str | None = None) -> None:
        """Pin a system prompt on the prefill side (its warm-up computes it there) and, once
        computed, on the decode side (its blocks sent once)."""
        self.prefill.pin_prompt(key, token_ids, tenant, adapter)
        if self.decode.blocks.enable_prefix_caching and self.prefill.pinned_prompt(key) is not None:
            self._pins_to_send.add(key)

    def unpin_prompt(self, key: str) -> None:
        self._pins_to_send.discard(key)
        self.prefill.unpin_prompt(key)
        self.decode.unpin_prompt(key)

    def _send_pins(self) -> list[RequestOutput]:
        """Send the pinned prompts whose warm-up is done to the decode side (those it has no room
        for yet: at a later step). Returns the outputs of decode requests that no longer fit."""
        outputs = []
        for key in list(self._pins_to_send):
            pin = self.prefill.pinned_prompt(key)
            if pin is None:  # its warm-up failed or was aborted
                self._pins_to_send.discard(key)
                continue
            if not pin.block_ids:
                continue
            block_ids = self._allocate_filled(pin.hashes, pin.block_ids)
            if block_ids is None:
                continue
            self._pins_to_send.discard(key)
            outputs += self.decode.hold_prompt(key, PinnedPrompt(list(pin.token_ids), pin.tenant, pin.adapter,
                                                                 block_ids, list(pin.hashes)))
        return outputs

    def _allocate_filled(self, hashes: list[bytes], source_ids: list[int]) -> list[int] | None:
        """Decode-side blocks holding the KV of the prefill side's cached `source_ids` (under
        `hashes`): the ones the decode side has cached, and copies of the rest; None if it has
        no room."""
        blocks = self.decode.blocks
        reused = blocks.match(hashes, len(source_ids))
        fresh = blocks.allocate(len(source_ids) - len(reused))
        if fresh is None:
            blocks.free(reused)
            return None
        blocks.register(fresh, hashes[len(reused):])
        self._copy(source_ids[len(reused):], fresh)
        blocks.mark_computed(fresh)
        self.num_blocks_reused += len(reused)
        return reused + fresh

    # Requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None = None, params: SamplingParams | None = None,
                    adapter: str | None = None, prompt_token_ids: list[int] | None = None,
                    tenant: str | None = None, **options: Any) -> Request:
        """Queue a request (LLMEngine.add_request's arguments): on the prefill side until its
        first token, then on the decode side. Its adapter must be servable on both."""
        if self.decode.has_request(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        params = params or SamplingParams()
        if adapter is not None:
            self.decode.adapter_digest(adapter)  # (UnknownAdapterError now, not after its prefill)
        kwargs = dict(params=params, adapter=adapter, tenant=tenant, **options)
        if (params.streaming_window or self.decode.streaming_window) is not None:
            return self.decode.add_request(request_id, prompt, prompt_token_ids=prompt_token_ids, **kwargs)
        token_ids = self.prefill.encode_prompt(prompt, prompt_token_ids)
        if len(token_ids) >= self.decode.max_model_len:
            raise InvalidRequestError(f"the prompt has {len(token_ids)} tokens; the decode side's context is "
                                      f"{self.decode.max_model_len}", param="prompt")
        return self.prefill.add_request(request_id, prompt_token_ids=token_ids,
                                        prefill_only=not params.is_scoring_only, **kwargs)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is (a side, or between them); every block it holds on
        either side returns. False if unknown."""
        if self.prefill.abort(request_id):
            return True
        found = self.decode.abort(request_id)
        self._release(request_id)
        return found

    def abort_all(self) -> int:
        """Stop every request on both sides and between them, and unpin every prompt: both
        engines are left idle, every block free. Returns how many requests were stopped."""
        count = self.prefill.abort_all()
        for prefilled in self.prefill.take_prefilled():  # (handed off by the step it collected)
            self.prefill.blocks.free(prefilled.block_ids)
            count += 1
        self._pins_to_send.clear()
        count += self.decode.abort_all()
        for request_id in list(self._transit):
            self._release(request_id)
        return count

    def has_unfinished_requests(self) -> bool:
        return self.prefill.has_unfinished_requests() or self.decode.has_unfinished_requests()

    @property
    def num_requests(self) -> int:
        return self.prefill.num_requests + self.decode.num_requests

    # The step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """A step of each side: the prefill side's outputs (first tokens, requests that end
        there), then the decode side's. Requests whose first token the prefill step sampled join
        the decode side's queue before its step."""
        outputs = self.prefill.step()
        for prefilled in self.prefill.take_prefilled():
            outputs += self._hand_over(prefilled)
        outputs += self._send_pins()
        decoded = self.decode.step()
        for output in decoded:
            if output.finished:  # ended before its KV was received (failed): let it go
                self._release(output.request_id)
        return outputs + decoded

    def _hand_over(self, prefilled: PrefilledRequest) -> list[RequestOutput]:
        """Queue a prefilled request on the decode side (its KV received when it is admitted);
        the output of its failure if the decode side cannot take it."""
        try:
            self.decode.admit_prefilled(prefilled)
        except LoraplexError as exc:
            self.prefill.blocks.free(prefilled.block_ids)
            request = prefilled.request
            return [RequestOutput(
                request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                token_ids=request.output_token_ids, text=getattr(prefilled.detokenizer, "text", ""),
                finished=True, finish_reason="error", adapter=request.adapter_name,
                error=f"{type(exc).__name__}: {exc}", error_code=getattr(exc, "code", None))]
        if prefilled.block_ids:
            self._transit[prefilled.request_id] = prefilled
        return []

    def _receive(self, request_id: str, first: int, block_ids: list[int]) -> None:
        """The decode side admitted a prefilled request: copy its prompt blocks from `first` on
        into `block_ids`; the prefill side's references go."""
        prefilled = self._transit.pop(request_id)
        self._copy(prefilled.block_ids[first:first + len(block_ids)], block_ids)
        self.num_blocks_reused += first
        self.prefill.blocks.free(prefilled.block_ids)

    def _copy(self, source_ids: list[int], target_ids: list[int]) -> None:
        """The KV of the prefill side's `source_ids` into the decode side's `target_ids`: copied
        here, or, with worker processes, sent by the prefill side's worker after the steps
        queued there (which wrote it) and received by the decode side's before its next step."""
        if not source_ids:
            return
        if self._workers is None:
            copy_kv_blocks(self.prefill.kv_cache, source_ids, self.decode.kv_cache, target_ids)
        else:
            from loraplex.worker.commands import ReceiveKv, SendKv  # (the worker side imports the engine)

            prefill_workers, decode_workers = self._workers
            prefill_workers.queue(SendKv(tuple(source_ids), peer=decode_workers.first_rank))
            decode_workers.queue(ReceiveKv(tuple(target_ids), peer=prefill_workers.first_rank))
        self.num_blocks_sent += len(source_ids)

    def _release(self, request_id: str) -> None:
        prefilled = self._transit.pop(request_id, None)
        if prefilled is not None:
            self.prefill.blocks.free(prefilled.block_ids)

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()

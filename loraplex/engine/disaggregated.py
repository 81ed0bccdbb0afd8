"""Disaggregated prefill and decode (DistServe): two engine cores, each an LLMEngine on its own
KV pool (its own block manager, scheduler, adapter cache and tenant counters), each side's model
in a worker process of its own (`processes`; docs/disaggregated.md), or both sharing one model
object in this process.

A request is prefilled on the prefill side under its adapter: its prompt computed and its first
token sampled (`add_request(..., prefill_only=True)`); it then leaves that engine holding its
prompt's blocks (`take_prefilled`) and joins the decode side's queue as a swapped request does
(`admit_prefilled`), its KV elsewhere. When the decode side admits it (its adapter in a slot
there, through the same lifecycle; room in its KV pool), the KV of the prompt blocks that the
decode side has not cached is copied into the blocks it allocated, and the request decodes from
its first token with the same sampling state (seed and token index). In one process the copy is
`copy_kv_blocks` from the prefill side's blocks, which it holds until then. Between worker
processes the prefill side's worker pushes the blocks into a staging area on the decode side's
GPU as soon as they are handed off (`PushKv`; the prefill side frees them at once) and the
decode side's worker copies them from there into its cache when it admits the request; where
staging has no room, the request keeps its prefill blocks and the decode side's worker copies
them out of the prefill side's cache, which it maps (device to device on GPUs, neither copy
involving the other process). Until it is admitted the request is between the sides: aborting
it frees the prefill side's blocks or its staging run. The decode side schedules, preempts (swap
or recompute, on its own pool), groups relay decodes and keeps VTC counters as a colocated
engine does; the prompt is charged once, on the prefill side.

A registered system prompt is pinned on the prefill side (computed there) and its blocks are
sent once to the decode side, which holds them too: requests that start with it find them
cached there, and only the rest of their blocks is pushed. Requests with attention sinks run
whole on the decode side; requests that only score their prompt, whole on the prefill side.

With `concurrent`, the prefill side steps on a thread of its own, so that neither side waits
for the other's steps (a long prompt step would otherwise hold up every decode step): the
caller's `step` runs the decode side and takes what the prefill side handed over since. One
lock guards the prefill side and the staging area; its thread lets go of it while it waits for
its device."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
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
from loraplex.engine.staging import Runs
from loraplex.engine.stats import (
    EngineStats,
    TransferStats,
    disaggregated_stats,
)
from loraplex.engine_config import ConfigError, EngineConfig
from loraplex.errors import InvalidRequestError, LoraplexError
from loraplex.model.llama import LlamaForCausalLM
from loraplex.types import RequestOutput, SamplingParams
from loraplex.worker.replies import KvReceived

logger = logging.getLogger(__name__)

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


STAGING_BYTES = 2 << 30
"""The decode side's staging area by default: 2 GiB (eight 2K-token prompts of a Llama-3-8B),
at most eight contexts' worth of blocks."""


def default_staging_blocks(decode: LLMEngine) -> int:
    """Blocks of the decode side's staging area by default (STAGING_BYTES)."""
    context_blocks = -(-decode.max_model_len // decode.config.cache.block_size)
    return max(1, min(STAGING_BYTES // decode.memory.kv_block_bytes, 8 * context_blocks))


@dataclass(frozen=True)
class Staged:
    """A pushed request's prompt blocks in the staging area: blocks [first, first + count) of
    its prompt at staging blocks [start, start + count)."""

    start: int
    first: int
    count: int


def _held(prefilled: PrefilledRequest, staged: Staged | None) -> list[int]:
    """The prefill-side blocks a prefilled request still holds: all of them, or, pushed, those
    the push left (a pinned prompt's)."""
    return prefilled.block_ids if staged is None else prefilled.block_ids[:staged.first]


class DisaggregatedEngine:
    """A prefill engine and a decode engine behind LLMEngine's interface (the parts the offline
    LLM and tests drive). One caller at a time (with `concurrent`, the prefill side's own thread
    beside it)."""

    def __init__(self, config: EngineConfig, decode_config: EngineConfig | None = None,
                 model: LlamaForCausalLM | None = None, processes: bool = False,
                 concurrent: bool = False, random_weights: bool = False,
                 staging_blocks: int | None = None) -> None:
        """The prefill side from `config` (the model folder `config.model`, or `model`), the
        decode side from `decode_config` (default: `config`). With `processes`, each side's model
        runs in a worker process of its own (on CUDA the prefill side on GPU 0, the decode side
        on GPU 1): the prefill side's worker pushes each request's prompt blocks into a staging
        area of `staging_blocks` on the decode side's (default: STAGING_BYTES; 0: none), and
        the decode side's worker copies them into its cache when it admits the request (or,
        where staging had no room, out of the prefill side's cache, which it maps: CUDA IPC, on
        CPU a shared file); without, both sides share one model object in this process (CPU
        only). With `concurrent`, the prefill side steps on a thread of its
        own (the module's docstring). `random_weights` (with `processes`; benchmarks): each
        worker fills its model with random weights, the folder needs config.json only."""
        decode_config = decode_config or config
        if config.tensor_parallel_size > 1 or decode_config.tensor_parallel_size > 1:
            raise ConfigError("disaggregate", "each side runs on one device: tensor_parallel_size must be 1")
        if config.cache.block_size != decode_config.cache.block_size:
            raise ConfigError("block_size", "the prefill and decode sides need the same block size")
        self._workers = None
        self._staging_blocks = 0
        if random_weights and not processes:
            raise ConfigError("disaggregate", "random weights are the worker processes' (processes=True)")
        if processes:
            self.prefill, self.decode = self._start_workers(config, decode_config, model, random_weights,
                                                            staging_blocks)
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
        self.num_blocks_staged = 0
        """Of the blocks sent, those pushed into the decode side's staging area."""
        self.prefill_busy_s = 0.0
        """With `concurrent`: seconds the prefill side's thread spent in steps that had work."""
        self.transfers = TransferStats()
        self._lock = threading.RLock()
        """Guards the prefill engine, the staging area and what the prefill side hands over
        (below)."""
        self._staging = Runs(self._staging_blocks)
        self._pushing: dict[str, tuple[PrefilledRequest, Staged]] = {}
        """Requests whose prompt blocks are being pushed into the staging area."""
        self._cancelled: set[str] = set()
        """Pushing requests aborted: their staging run goes when the push is answered."""
        self._pushed: list[PrefilledRequest] = []
        """Pushed requests, for the decode side's queue."""
        self._staged: dict[str, Staged] = {}
        """Where each pushed request's blocks are in the staging area, until received."""
        self._wake = threading.Condition(self._lock)
        self._handed_over: list[PrefilledRequest] = []
        self._prefill_outputs: list[RequestOutput] = []
        self._prefill_error: BaseException | None = None
        self._stopping = False
        self._pauses = 0  # callers waiting for, or holding, the prefill side's thread parked
        self._parked = False
        self._thread: threading.Thread | None = None
        if concurrent:
            self.prefill.waiting = self._unlocked
            self._thread = threading.Thread(target=self._run_prefill, name="loraplex-prefill", daemon=True)
            self._thread.start()

    def _start_workers(self, config: EngineConfig, decode_config: EngineConfig,
                       model: LlamaForCausalLM | None, random_weights: bool,
                       staging_blocks: int | None) -> tuple[LLMEngine, LLMEngine]:
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
            prefill = LLMEngine(config, workers=prefill_workers, random_weights=random_weights)
            try:
                decode = LLMEngine(decode_config, workers=decode_workers, tokenizer=prefill.tokenizer,
                                   random_weights=random_weights)
                decode_workers.map_peer_kv(prefill_workers.share_kv())
                if staging_blocks is None:
                    staging_blocks = default_staging_blocks(decode)
                if staging_blocks:
                    prefill_workers.map_peer_kv(decode_workers.share_kv(staging_blocks), staging=True)
                self._staging_blocks = staging_blocks
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

    @property
    def is_concurrent(self) -> bool:
        """The prefill side steps on a thread of its own."""
        return self._thread is not None

    # Adapters and tenants: on both sides ----------------------------------------------------
    def add_adapter(self, name: str, source: str | Path | LoraAdapter | HostAdapter) -> str:
        """Make an adapter servable under `name` on both sides; returns its digest."""
        with self._lock:
            digest = self.prefill.add_adapter(name, source)
        self.decode.add_adapter(name, source)
        return digest

    def remove_adapter(self, name: str) -> None:
        with self._lock:
            self.prefill.remove_adapter(name)
        self.decode.remove_adapter(name)

    def set_adapter_loader(self, loader: AdapterLoader) -> None:
        with self._lock:
            self.prefill.set_adapter_loader(loader)
        self.decode.set_adapter_loader(loader)

    def adapter_digest(self, adapter: str) -> str:
        return self.decode.adapter_digest(adapter)

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        with self._lock:
            self.prefill.set_tenant_weight(tenant, weight)
        self.decode.set_tenant_weight(tenant, weight)

    # Registered system prompts ------------------------------------------------------------
    def pin_prompt(self, key: str, token_ids: list[int], tenant: str | None = None,
                   adapter: str | None = None) -> None:
        """Pin a system prompt on the prefill side (its warm-up computes it there) and, once
        computed, on the decode side (its blocks sent once)."""
        with self._lock:
            self.prefill.pin_prompt(key, token_ids, tenant, adapter)
            if self.decode.blocks.enable_prefix_caching and self.prefill.pinned_prompt(key) is not None:
                self._pins_to_send.add(key)
            self._wake.notify_all()

    def unpin_prompt(self, key: str) -> None:
        with self._lock:
            self._pins_to_send.discard(key)
            self.prefill.unpin_prompt(key)
        self.decode.unpin_prompt(key)

    def _send_pins(self) -> list[RequestOutput]:
        """Send the pinned prompts whose warm-up is done to the decode side (those it has no room
        for yet: at a later step). Returns the outputs of decode requests that no longer fit."""
        outputs = []
        for key in list(self._pins_to_send):
            with self._lock:
                pin = self.prefill.pinned_prompt(key)
                if pin is None:  # its warm-up failed or was aborted
                    self._pins_to_send.discard(key)
                    continue
                if not pin.block_ids:
                    continue
                pin = PinnedPrompt(list(pin.token_ids), pin.tenant, pin.adapter, list(pin.block_ids),
                                   list(pin.hashes))
            block_ids = self._allocate_filled(pin.hashes, pin.block_ids)
            if block_ids is None:
                if not self.decode.has_unfinished_requests():  # no room will come: requests send its blocks
                    logger.warning("pinned prompt %r does not fit on the decode side: not held there", key)
                    with self._lock:
                        self._pins_to_send.discard(key)
                continue
            outputs += self.decode.hold_prompt(key, PinnedPrompt(pin.token_ids, pin.tenant, pin.adapter,
                                                                 block_ids, pin.hashes))
            with self._lock:  # (held on both sides now: requests that start with it push the rest only)
                self._pins_to_send.discard(key)
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
        if self.decode.has_request(request_id) or request_id in self._transit:
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
        with self._lock:
            if request_id in self._pushing or any(p.request_id == request_id
                                                  for p in self._handed_over + self._pushed):
                raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
            if options.get("sample_of") is not None and not self.prefill.has_request(options["sample_of"]):
                kwargs["sample_of"] = None  # (its donor left for the decode side: the prefix cache shares)
            request = self.prefill.add_request(request_id, prompt_token_ids=token_ids,
                                               prefill_only=not params.is_scoring_only, **kwargs)
            self._wake.notify_all()
        return request

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is (a side, or between them); every block it holds on
        either side returns. False if unknown."""
        with self._lock:
            if self.prefill.abort(request_id):
                self._drop_prefill_outputs({request_id})
                return True
            if request_id in self._pushing and request_id not in self._cancelled:
                self._cancelled.add(request_id)
                self._drop_prefill_outputs({request_id})
                return True
            for waiting in (self._handed_over, self._pushed):
                for prefilled in waiting:
                    if prefilled.request_id == request_id:
                        waiting.remove(prefilled)
                        self._let_go(prefilled)
                        self._drop_prefill_outputs({request_id})
                        return True
        found = self.decode.abort(request_id)
        self._release(request_id)
        return found

    def _drop_prefill_outputs(self, request_ids: set[str]) -> None:
        """(Under the lock.) Forget the prefill side's outputs of aborted requests not yet
        returned."""
        self._prefill_outputs = [o for o in self._prefill_outputs if o.request_id not in request_ids]

    def abort_all(self) -> int:
        """Stop every request on both sides and between them, and unpin every prompt: both
        engines are left idle, every block free. Returns how many requests were stopped."""
        with self._prefill_paused():  # (its abort_all collects the step in flight)
            count = self.prefill.abort_all()
            for prefilled in self._handed_over + self._pushed + self.prefill.take_prefilled():
                self._let_go(prefilled)
                count += 1
            count += len(set(self._pushing) - self._cancelled)
            self._cancelled.update(self._pushing)  # (their staging runs go as the pushes are answered)
            self._handed_over, self._pushed, self._prefill_outputs = [], [], []
            self._pins_to_send.clear()
        count += self.decode.abort_all()
        for request_id in list(self._transit):
            self._release(request_id)
        return count

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            if (self.prefill.has_unfinished_requests() or self._handed_over or self._prefill_outputs
                    or self._pins_to_send or self._pushed or len(self._pushing) > len(self._cancelled)):
                return True
        return self.decode.has_unfinished_requests()

    @property
    def num_requests(self) -> int:
        with self._lock:
            on_prefill = (self.prefill.num_requests + len(self._handed_over) + len(self._pushed)
                          + len(self._pushing) - len(self._cancelled))
        return on_prefill + self.decode.num_requests

    # The step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """A step of the decode side, after the prefill side's: its outputs (first tokens,
        requests that end there) first, then the decode side's. Requests whose first token the
        prefill side sampled join the decode side's queue before its step. With `concurrent`,
        the prefill side's steps run on their own thread: this one takes what they produced
        since the last call."""
        if self._thread is None:
            outputs = self.prefill.step()
            with self._lock:
                outputs += self._settle_pushes()
                handed_over = self._take_prefilled()
        else:
            with self._lock:
                if self._prefill_error is not None:
                    raise RuntimeError("the prefill side failed") from self._prefill_error
                outputs, self._prefill_outputs = self._prefill_outputs, []
                handed_over, self._handed_over = self._handed_over, []
        for prefilled in handed_over:
            outputs += self._hand_over(prefilled)
        outputs += self._send_pins()
        decoded = self.decode.step()
        for output in decoded:
            if output.finished:  # ended before its KV was received (failed): let it go
                self._release(output.request_id)
        return outputs + decoded

    def _run_prefill(self) -> None:
        """The prefill side's thread (`concurrent`): step while it has requests, hand over what
        each step prefilled; sleep until a request or a pin arrives."""
        while True:
            with self._lock:
                while not self._stopping and (self._pauses or not (self.prefill.has_unfinished_requests()
                                                                   or self._pushing)):
                    self._parked = True
                    self._wake.notify_all()
                    self._wake.wait()
                self._parked = False
                if self._stopping:
                    return
                try:
                    started = time.perf_counter()
                    outputs = self.prefill.step()
                    self.prefill_busy_s += time.perf_counter() - started
                    outputs += self._settle_pushes()
                    handed_over = self._take_prefilled()
                except BaseException as exc:  # (raised by the caller's next step)
                    logger.exception("the prefill side's step failed")
                    self._prefill_error, self._parked = exc, True
                    self._wake.notify_all()
                    return
                self._prefill_outputs += outputs
                self._handed_over += handed_over
            time.sleep(0)  # the caller, waiting for the lock, takes it now

    def _take_prefilled(self) -> list[PrefilledRequest]:
        """(Under the lock.) The prefilled requests ready for the decode side: those the prefill
        side handed off at its last step whose blocks it could not push into the staging area
        (they hold them), and those whose push is done."""
        ready = [prefilled for prefilled in self.prefill.take_prefilled() if not self._push(prefilled)]
        ready += self._pushed
        self._pushed = []
        return ready

    def _push(self, prefilled: PrefilledRequest) -> bool:
        """(Under the lock.) Queue the push of a prefilled request's prompt blocks into the
        staging area on the prefill side's worker (after the steps that wrote them), and let
        them go (the steps that could reuse them are queued after it); False where there is no
        staging area or no room. The leading blocks of a pinned prompt that the decode side
        holds are not sent: the request keeps them (the decode side finds them cached)."""
        if not self._staging_blocks or not prefilled.block_ids:
            return False
        first = self._held_by_decode(prefilled.block_ids)
        count = len(prefilled.block_ids) - first
        start = self._staging.take(count) if count else None
        if start is None:
            return False
        from loraplex.worker.commands import PushKv  # (the worker side imports the engine)

        staged = Staged(start, first, count)
        self._pushing[prefilled.request_id] = prefilled, staged
        self._workers[0].queue(PushKv(tuple(prefilled.block_ids[first:]), start),
                               on_done=partial(self._pushed_done, prefilled.request_id))
        self.prefill.blocks.free(prefilled.block_ids[first:])
        self.num_blocks_sent += count
        self.num_blocks_staged += count
        return True

    def _held_by_decode(self, block_ids: list[int]) -> int:
        """(Under the lock.) How many of `block_ids`' leading blocks are a pinned prompt's
        that the decode side holds too."""
        held = 0
        for key in self.prefill.pinned_prompts():
            pin = self.prefill.pinned_prompt(key)
            if key not in self._pins_to_send and pin is not None and len(pin.block_ids) > held \
                    and block_ids[:len(pin.block_ids)] == pin.block_ids:
                held = len(pin.block_ids)
        return held

    def _pushed_done(self, request_id: str, received: KvReceived) -> None:
        """A push is done (read with the prefill side's worker's replies): its request is ready
        for the decode side, or, aborted meanwhile, lets go of what it holds."""
        with self._lock:
            prefilled, staged = self._pushing.pop(request_id)
            self.transfers.add(staged.count, received.num_bytes, received.seconds)
            self._staged[request_id] = staged
            if request_id in self._cancelled:
                self._cancelled.discard(request_id)
                self._let_go(prefilled)
            else:
                self._pushed.append(prefilled)

    def _settle_pushes(self) -> list[RequestOutput]:
        """(Under the lock.) With the prefill side idle, read the answers of the pushes still
        queued on its worker (a busy side reads them with its next step's); the outputs of the
        step it had in flight, if any."""
        if not self._pushing or self.prefill.has_unfinished_requests():
            return []
        outputs = self.prefill.drain()
        self._workers[0].acknowledge_queued()
        return outputs

    def _let_go(self, prefilled: PrefilledRequest) -> None:
        """(Under the lock.) Free what a prefilled request holds on the prefill side (its
        blocks, or those not pushed) and its staging run."""
        staged = self._staged.pop(prefilled.request_id, None)
        self.prefill.blocks.free(_held(prefilled, staged))
        if staged is not None:
            self._staging.give_back(staged.start, staged.count)

    @contextlib.contextmanager
    def _prefill_paused(self) -> Iterator[None]:
        """The lock, with the prefill side's thread (if any) parked between its steps: the
        caller may then do anything with the prefill side, its step in flight included."""
        with self._lock:
            if self._thread is None:
                yield
                return
            self._pauses += 1
            try:
                while not self._parked:
                    self._wake.wait()
                yield
            finally:
                self._pauses -= 1
                self._wake.notify_all()

    @contextlib.contextmanager
    def _unlocked(self) -> Iterator[None]:
        """The prefill side's `waiting`: on its thread, the lock is let go while its step waits
        for the device."""
        if threading.current_thread() is not self._thread:
            yield
            return
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()

    def _hand_over(self, prefilled: PrefilledRequest) -> list[RequestOutput]:
        """Queue a prefilled request on the decode side (its KV received when it is admitted);
        the output of its failure if the decode side cannot take it."""
        try:
            self.decode.admit_prefilled(prefilled)
        except LoraplexError as exc:
            with self._lock:
                self._let_go(prefilled)
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
        into `block_ids`; the prefill side's references go (the copy holds its own until done)."""
        prefilled = self._transit.pop(request_id)
        with self._lock:
            staged = self._staged.pop(request_id, None)
        if staged is None:
            self._copy(prefilled.block_ids[first:first + len(block_ids)], block_ids)
        else:  # blocks [first, staged.first) from the prefill side's cache, the rest from staging
            pulled = max(staged.first - first, 0)
            self._copy(prefilled.block_ids[first:staged.first], block_ids[:pulled])
            self._unstage(staged, max(first - staged.first, 0), block_ids[pulled:])
        self.num_blocks_reused += first
        with self._lock:
            self.prefill.blocks.free(_held(prefilled, staged))

    def _unstage(self, staged: Staged, skip: int, target_ids: list[int]) -> None:
        """Copy a pushed request's staged blocks, but the first `skip`, into the decode side's
        `target_ids` (its worker, before its next step), then free the staging run."""
        if not target_ids:
            with self._lock:
                self._staging.give_back(staged.start, staged.count)
            return
        from loraplex.worker.commands import ReceiveKv  # (the worker side imports the engine)

        sources = tuple(range(staged.start + skip, staged.start + skip + len(target_ids)))
        self._workers[1].queue(ReceiveKv(sources, tuple(target_ids), from_staging=True),
                               on_done=lambda _: self._give_back(staged))

    def _give_back(self, staged: Staged) -> None:
        with self._lock:
            self._staging.give_back(staged.start, staged.count)

    def _copy(self, source_ids: list[int], target_ids: list[int]) -> None:
        """The KV of the prefill side's `source_ids` into the decode side's `target_ids`: copied
        here, or, with worker processes, by the decode side's worker out of the prefill side's
        cache before the decode side's next step. The source blocks hold a reference of the
        copy's until it is done, so that no prefill step reuses them first."""
        if not source_ids:
            return
        with self._lock:
            self.prefill.blocks.share(source_ids)
        if self._workers is None:
            started = time.perf_counter()
            copy_kv_blocks(self.prefill.kv_cache, source_ids, self.decode.kv_cache, target_ids)
            block = self.decode.kv_cache[0]
            num_bytes = len(source_ids) * block.numel() * block.element_size()
            self._copied(source_ids, KvReceived(num_bytes, time.perf_counter() - started))
        else:
            from loraplex.worker.commands import ReceiveKv  # (the worker side imports the engine)

            _, decode_workers = self._workers
            decode_workers.queue(ReceiveKv(tuple(source_ids), tuple(target_ids)),
                                 on_done=partial(self._copied, source_ids))
        self.num_blocks_sent += len(source_ids)

    def _copied(self, source_ids: list[int], received: KvReceived) -> None:
        """A copy is done: its references to the source blocks go; it is counted."""
        with self._lock:
            self.prefill.blocks.free(source_ids)
        self.transfers.add(len(source_ids), received.num_bytes, received.seconds)

    def _release(self, request_id: str) -> None:
        prefilled = self._transit.pop(request_id, None)
        if prefilled is not None:
            with self._lock:
                self._let_go(prefilled)

    # Serving: what the engine-core process and the server read ----------------------------
    # (Facts fixed when the sides are built are read without the lock.)
    @property
    def model_config(self) -> Any:
        """The model's ModelConfig (one model on both sides)."""
        return self.prefill.model_config

    @property
    def device(self) -> torch.device:
        return self.decode.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decode.dtype

    @property
    def max_model_len(self) -> int:
        """The longest context both sides hold."""
        return min(self.prefill.max_model_len, self.decode.max_model_len)

    @property
    def streaming_window(self) -> Any:
        """The decode side's default StreamingWindow (requests with one run whole there)."""
        return self.decode.streaming_window

    @property
    def memory(self) -> Any:
        """The decode side's MemoryPlan (each side plans its own pool from the same options)."""
        return self.decode.memory

    @property
    def graphs(self) -> Any:
        """The decode side's CaptureReport (None with worker processes, which capture none)."""
        return self.decode.graphs

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.prefill.eos_token_ids

    @property
    def grammars(self) -> Any:
        """The prefill side's GrammarCompiler (thread-safe on its own; a request's matcher
        travels with it to the decode side)."""
        return self.prefill.grammars

    def window_problem(self, window: Any) -> str | None:
        return self.decode.window_problem(window)

    def pinned_prompts(self) -> dict[str, int]:
        """Each pinned prompt's key -> the KV blocks it holds on the prefill side, where prompts
        are pinned first (0 while its warm-up runs)."""
        with self._lock:
            return self.prefill.pinned_prompts()

    def reset_prefix_cache(self) -> int:
        """Forget the cached prompt blocks that nobody holds, on both sides; how many."""
        with self._lock:
            dropped = self.prefill.reset_prefix_cache()
        return dropped + self.decode.reset_prefix_cache()

    def stats(self) -> EngineStats:
        """Both sides' figures as one EngineStats (loraplex.engine.stats.disaggregated_stats):
        summed, with each side's queue and KV pool and the KV transfers since start."""
        with self._lock:
            prefill = self.prefill.stats()
            num_between = (len(self._handed_over) + len(self._pushed) + len(self._pushing)
                           - len(self._cancelled))
        return disaggregated_stats(prefill, self.decode.stats(), num_between, self.transfers.snapshot())

    def close(self) -> None:
        """Stop the prefill side's thread, then both engines (and their workers)."""
        if self._thread is not None:
            with self._lock:
                self._stopping = True
                self._wake.notify_all()
            self._thread.join()
        self.prefill.close()
        self.decode.close()

"""The step-level engine that the offline API and the server drive: `add_request`, `step`,
`abort`, adapters and tenant weights. Single-threaded: one caller at a time.

A step is scheduled, launched on the device and collected. With async scheduling (CUDA), a
`step()` call launches the next step before it collects the one in flight, so the host plans
step N+1 and processes step N's tokens while the device computes step N+1.

Building the engine does all the slow work up front: the weights are loaded, the pool that the KV
cache and the adapter slots share is sized from measured activations, and every decode graph is
captured, so that no request pays for any of it."""

from __future__ import annotations

import contextlib
import logging
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.adapter_format import LoraAdapter
from loraplex.engine.adapter_cache import AdapterCache, AdapterLoader, Wait
from loraplex.engine.blending import AdapterSlot, DocumentBlend, prefill_with_documents
from loraplex.engine.block_manager import BlockManager, HostBlockPool
from loraplex.engine.cuda_graphs import CaptureReport
from loraplex.engine.detokenizer import Detokenizer
from loraplex.engine.grammar import CompiledGrammar, GrammarCompiler, allocate_masks
from loraplex.engine.handoff import PrefilledRequest
from loraplex.engine.kv_swap import KvSwapper, SwapStats
from loraplex.engine.local_adapters import LocalAdapters
from loraplex.engine.lora_weights import (
    HostAdapter,
    LoraSlotBuffers,
    adapter_bytes,
    make_host_adapter,
    max_adapter_pool_bytes,
)
from loraplex.engine.model_runner import LaunchedStep, ModelRunner, measure_step_bytes
from loraplex.engine.out_of_memory import (
    is_out_of_memory,
    largest_request,
    out_of_memory_error,
    release_cached_memory,
    swapped_by,
)
from loraplex.engine.plan import StepPlan, StepResult, TokenMasks
from loraplex.engine.policy import FcfsPolicy, SchedulingPolicy, VtcPolicy
from loraplex.engine.prefix_cache import block_hashes
from loraplex.engine.relay_groups import RelayRule
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.sizing import (
    MemoryPlan,
    cuda_budget,
    kv_block_bytes,
    kv_cache_view,
    make_pool,
    plan_memory,
    resolve_device,
    resolve_dtype,
    resolve_max_model_len,
)
from loraplex.engine.stats import EngineStats
from loraplex.engine.streaming import window_problem
from loraplex.engine.tenants import DEFAULT_TENANT, TenantTable
from loraplex.engine_config import ConfigError, EngineConfig
from loraplex.errors import InvalidRequestError, UnknownAdapterError
from loraplex.json_limits import loads_bounded
from loraplex.kernels import Ops, select_ops
from loraplex.kernels.reference import PAGE_RANK
from loraplex.model.llama import LlamaForCausalLM
from loraplex.model.loader import load_model
from loraplex.model.model_config import MAX_CONFIG_DEPTH, ModelConfig
from loraplex.model.tokenizer import load_tokenizer
from loraplex.types import FinishReason, RequestOutput, SamplingParams, StreamingWindow

if TYPE_CHECKING:
    from loraplex.worker.workers import TensorParallelWorkers  # (the worker side imports the engine)

logger = logging.getLogger(__name__)

DIGEST_PATTERN = re.compile(r"[0-9a-f]{64}")
DEFAULT_HOST_ADAPTERS = 64
"""Adapters of the largest rank that the host tier holds when neither max_cpu_loras nor
max_loras is set."""
IDLE_WAIT_S = 0.0005
"""A step with nothing to run pauses this long, so that a caller stepping in a loop while
requests wait for adapter loads does not keep the loader threads from the interpreter."""


@dataclass
class InFlight:
    """A launched step and the requests whose tokens it samples, in order."""

    plan: StepPlan
    sampling: list[Request]
    launched: LaunchedStep
    scored: list[Request] = field(default_factory=list)
    """Requests that generate nothing and whose prompt this step completes."""

    @property
    def is_constrained(self) -> bool:
        """Some request it samples follows a grammar (its next mask needs this step's token)."""
        return any(r.matcher is not None for r in self.sampling)


@dataclass
class PinnedPrompt:
    """A registered system prompt whose full KV blocks the engine holds (never evicted)."""

    token_ids: list[int]
    tenant: str
    adapter: str | None
    """Adapter digest (None: the base model)."""
    block_ids: list[int] = field(default_factory=list)
    """Held blocks; empty until its warm-up request has computed them."""
    hashes: list[bytes] = field(default_factory=list)
    """The held blocks' prefix-cache hashes."""


class LLMEngine:
    def __init__(self, config: EngineConfig, model: LlamaForCausalLM | None = None,
                 random_weights: bool = False, tokenizer: Any = None,
                 workers: TensorParallelWorkers | None = None) -> None:
        """Load the model folder `config.model`, or serve `model` (already on its device, e.g.
        random weights for a benchmark; it must use the op set its device and config select)
        with `tokenizer` (None: prompts come as token ids).
        With `tensor_parallel_size` > 1 the model's shards live in worker processes
        (loraplex/worker/executor.py), and `random_weights` fills them with random weights
        (benchmarks: the folder needs config.json only); `workers` (spawned already, e.g. a
        side of disaggregated prefill and decode) runs the model there instead."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.executor = None
        if model is not None and (config.tensor_parallel_size > 1 or workers is not None):
            raise ValueError("a model object runs in this process: tensor_parallel_size must be 1, "
                             "and no workers")
        if model is None:
            self.model_config = ModelConfig.load(config.model)
            self.tokenizer = None if random_weights else load_tokenizer(config.model)
            self.max_model_len = resolve_max_model_len(config, self.model_config)
            ops = select_ops(self.device, config.kernels, check_inputs=False)
        else:
            self.model_config, self.tokenizer, self.model, ops = model.config, tokenizer, model, model.ops
            self.max_model_len = min(config.max_model_len or model.max_positions, model.max_positions)
        use_graphs = not config.enforce_eager and self.device.type == "cuda"
        max_rank = config.lora.max_lora_rank
        block_size = config.cache.block_size
        if config.tensor_parallel_size > 1 or workers is not None:
            from loraplex.worker.executor import TensorParallelExecutor  # the worker side imports the engine

            self.model = None
            self.executor = TensorParallelExecutor.start(config, self.model_config, self.dtype, self.device,
                                                         self.max_model_len, random_weights, workers)
            self.memory, self.lora = self.executor.memory, self.executor.slots
        else:
            if model is None:
                if random_weights:
                    raise ValueError("random_weights is for tensor-parallel workers; pass a model")
                self.model = load_model(config.model, self.model_config, ops, self.dtype, self.device,
                                        self.max_model_len)
            self.memory = self._plan_memory(ops, use_graphs)
            self.pool = make_pool(self.memory, self.device)
            self.lora = LoraSlotBuffers(self.model_config, self.memory.num_lora_slots, max_rank, self.dtype,
                                        self.device, base_weights=self.model.group_weights, pool=self.pool,
                                        block_bytes=self.memory.kv_block_bytes)
            self.kv_cache = kv_cache_view(self.pool, self.model_config, block_size, self.dtype)
        logger.info("memory: %s", self.memory.describe())
        self.max_model_len = min(self.max_model_len, self.memory.num_kv_blocks * block_size)
        self.streaming_window: StreamingWindow | None = None
        """Attention sinks for requests that set none of their own (`sliding_window`)."""
        if config.cache.sliding_window is not None:
            self.streaming_window = StreamingWindow(config.cache.sliding_window, config.cache.attention_sinks,
                                                    param="sliding_window")
            if (problem := self.window_problem(self.streaming_window)) is not None:
                raise ConfigError("sliding_window", problem)
        self.blocks = BlockManager(self.memory.num_pool_blocks, block_size,
                                   enable_prefix_caching=config.cache.enable_prefix_caching,
                                   max_kv_blocks=self.memory.max_kv_blocks)
        block_bytes = self.memory.kv_block_bytes
        num_host_blocks = KvSwapper.host_blocks_for(config.cache.swap_space, block_bytes)
        self.local_adapters = LocalAdapters(self.model_config.shape, max_rank)
        self._external_loader = False
        # An adapter in the host tier: its tensors, and its pool pages (packed by
        # LoraSlotBuffers.prepare on a load thread), from which loads copy; both pinned on CUDA,
        # where torch's pinned blocks, once freed, serve the next adapters without new page faults.
        max_adapter = adapter_bytes(self.model_config, max_rank, self.dtype)
        if isinstance(self.lora, LoraSlotBuffers):
            max_adapter += self.lora.max_adapter_pages * self.lora.page_bytes
        make_host = partial(make_host_adapter, config=self.model_config, dtype=self.dtype,
                            pin=self.device.type == "cuda" and self.executor is None)
        self.adapters = AdapterCache(
            self.lora, self.local_adapters.load, make_host,
            max_host_bytes=self._max_host_adapters() * max_adapter, max_adapter_bytes=max_adapter,
            blocks=self.blocks, slot_blocks=self.memory.slot_blocks, max_resident=config.lora.max_loras)
        self.tenants = TenantTable()
        self.scheduler = Scheduler(config.scheduler, self.blocks, self.adapters, self._policy(),
                                   HostBlockPool(num_host_blocks) if num_host_blocks else None)
        self.graphs: CaptureReport | None = None
        if self.executor is not None:
            self.runner = self.executor.runner
        else:
            self.runner = ModelRunner(
                self.model, self.kv_cache, self.lora, ops, config.scheduler.max_num_seqs,
                config.scheduler.max_num_batched_tokens, self.max_model_len,
                use_cuda_graphs=use_graphs, num_host_blocks=num_host_blocks,
                flora_graphs=config.lora.flora_graphs, relay=RelayRule(config.relay_attention),
                mixed_graphs=config.mixed_step_graphs)
            self.graphs = self.runner.graphs.capture_all() if use_graphs else None
            if self.device.type == "cuda":  # compiles kernels now, not on the first requests' time
                started = time.perf_counter()
                num_steps = self.runner.warm_up(config.scheduler.max_num_batched_tokens)
                logger.info("warmed up %d prefill step shapes in %.1f s", num_steps,
                            time.perf_counter() - started)
        # (prompt steps run eagerly, decodes from graphs; with mixed-step graphs most run as graphs too)
        self.scheduler.delays_prompts = use_graphs and not config.mixed_step_graphs
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.device.type == "cuda")
        self._in_flight: InFlight | None = None
        self.waiting: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext
        """Entered while a step waits for the device (or the workers): an owner that shares
        this engine between threads under a lock lets go of it there (DisaggregatedEngine)."""
        self._on_step_timed: Callable[[StepPlan, float], None] | None = None
        self.eos_token_ids = frozenset(self._eos_ids())
        self._requests: dict[str, Request] = {}
        self._detokenizers: dict[str, Detokenizer] = {}
        self._orphans: set[str] = set()  # removed adapters still used by requests
        self._arrivals = 0
        self._seeds = random.Random(config.seed)
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_document_prefills = 0
        """Registered documents whose KV was computed alone (once per tenant, adapter and text
        while the prefix cache keeps it)."""
        self.num_blended_prompts = self.num_blend_reused_tokens = 0
        self._num_blends = 0
        self._to_blend: list[Request] = []
        """Requests whose documents are blended under their adapter once it is in a slot."""
        self._pins: dict[str, PinnedPrompt] = {}
        self._pin_by_request: dict[str, str] = {}  # warm-up request id -> pin key
        self._prefilled: list[PrefilledRequest] = []
        """Prefill-only requests that sampled their first token, for `take_prefilled`."""
        self.receive_kv: Callable[[str, int, list[int]], None] | None = None
        """Disaggregated decode: fills, before the step after their admission, the blocks of
        requests admitted with their KV on the prefill engine: (request id, index in its prompt's
        blocks of the first block to fill, this engine's blocks from there)."""
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self._constrained: set[str] = set()
        """Requests that follow a grammar: while none does, a step builds no masks and keeps
        its overlap (the decode step's usual case costs nothing for structured outputs)."""

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler for this model's tokenizer (made on first use;
        thread-safe: the server compiles on worker threads)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler.for_model(self.tokenizer, self.model_config.vocab_size,
                                                           self.eos_token_ids)
            return self._grammars

    def _policy(self) -> SchedulingPolicy:
        config = self.config.scheduler
        if config.scheduling_policy == "fcfs":
            return FcfsPolicy(self.tenants)
        return VtcPolicy(self.tenants, config.fairness_bound)

    def _max_host_adapters(self) -> int:
        lora = self.config.lora
        return lora.max_cpu_loras or 2 * (lora.max_loras or DEFAULT_HOST_ADAPTERS // 2)

    def _plan_memory(self, ops: Ops, use_graphs: bool) -> MemoryPlan:
        config, model = self.config, self.model_config
        page_bytes = kv_block_bytes(model, config.cache.block_size, self.dtype)
        slot_bytes = max_adapter_pool_bytes(model, config.lora.max_lora_rank, self.dtype, page_bytes)
        # as many table rows as adapters of one rank page on every module fit (rank 8: a rank-64
        # adapter's slot's pages hold eight); the rows cost little (7 KiB each at rank 16, 8B)
        smallest = max_adapter_pool_bytes(model, min(PAGE_RANK, config.lora.max_lora_rank), self.dtype,
                                          page_bytes)
        if self.device.type != "cuda":
            return plan_memory(config, model, self.dtype, self.max_model_len, slot_bytes,
                               config.cache.cpu_kv_cache_bytes, min_adapter_bytes=smallest)
        activations, graphs = measure_step_bytes(
            self.model, ops, self._kv_block_shape(), config.lora.max_lora_rank, config.scheduler.max_num_seqs,
            config.scheduler.max_num_batched_tokens, self.max_model_len, use_graphs,
            mixed_graphs=config.mixed_step_graphs)
        budget = cuda_budget(config.cache.gpu_memory_utilization, self.device, activations, graphs)
        return plan_memory(config, model, self.dtype, self.max_model_len, slot_bytes, budget,
                           activations, graphs, min_adapter_bytes=smallest)

    def _kv_block_shape(self) -> tuple[int, ...]:
        m = self.model_config
        return m.num_layers, 2, self.config.cache.block_size, m.num_kv_heads, m.head_dim

    # Adapters -----------------------------------------------------------------------------
    def add_adapter(self, name: str, source: str | Path | LoraAdapter | HostAdapter) -> str:
        """Make an adapter servable under `name` (a PEFT folder, validated now and read again
        whenever the host tier needs it, or an adapter object); returns its digest."""
        if isinstance(source, HostAdapter) and isinstance(self.lora, LoraSlotBuffers):
            self.lora.prepare(source)  # in host memory as the pool's pages hold it
        digest = self.local_adapters.add(name, source)
        self._orphans.discard(digest)
        return digest

    def remove_adapter(self, name: str) -> None:
        """Forget `name`. Requests already using the adapter finish with it; its memory is
        freed when the last of them ends."""
        digest = self.local_adapters.remove(name)
        if digest is not None:
            self._orphans.add(digest)
            self._drop_orphans()

    def set_adapter_loader(self, loader: AdapterLoader) -> None:
        """Serve adapters by digest from `loader` (the server's blob store): a request may then
        name an adapter by its digest. Call before serving."""
        local = self.local_adapters

        def load(digest: str) -> LoraAdapter | HostAdapter:
            return local.load(digest) if digest in local.names.values() else loader(digest)

        self.adapters.set_loader(load)
        self._external_loader = True

    def adapter_digest(self, adapter: str) -> str:
        """The digest of an added adapter's weights (or, with an adapter loader, a digest given
        as the name)."""
        digest = self.local_adapters.resolve(adapter)
        if digest is not None:
            return digest
        if self._external_loader and DIGEST_PATTERN.fullmatch(adapter):
            return adapter
        raise UnknownAdapterError(f"adapter {adapter!r} is not loaded", param="adapter")

    def _drop_orphans(self) -> None:
        for digest in [d for d in self._orphans if not self.adapters.is_needed(d)]:
            self._orphans.discard(digest)
            self.local_adapters.drop(digest)
            self.adapters.forget(digest)

    # Tenants ------------------------------------------------------------------------------
    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """A tenant's share under contention; the scheduling policy reads it at the next step."""
        self.tenants.set_weight(tenant, weight)

    # Requests -----------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | None = None, params: SamplingParams | None = None,
        adapter: str | None = None, prompt_token_ids: list[int] | None = None,
        tenant: str | None = None, sample_of: str | None = None,
        grammar: CompiledGrammar | None = None, documents: DocumentBlend | None = None,
        prefill_only: bool = False,
    ) -> Request:
        """Queue a request. Exactly one of `prompt` (text) and `prompt_token_ids` is given;
        `adapter` names an added adapter (or, with an adapter loader, gives a digest) or is None
        for the base model; `tenant` is DEFAULT_TENANT when not given. `sample_of` names a queued
        request of the same prompt and adapter that this one is another sample of: it shares
        that request's prompt KV blocks rather than computing them again. With
        `params.structured`, `grammar` is its compiled grammar (compiled here when not given:
        the server compiles beforehand, off the engine thread). `documents` marks where
        registered documents lie in the prompt: their KV is reused and blended (CacheBlend, see
        loraplex.engine.blending) before the request is queued. `prefill_only`: the request leaves
        this engine once its first token is sampled, unless that ends it (`take_prefilled`)."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        params = params or SamplingParams()
        streaming = self._streaming_of(params)
        token_ids = self.encode_prompt(prompt, prompt_token_ids, past_context=streaming is not None)
        digest = self.adapter_digest(adapter) if adapter is not None else None
        tenant = tenant or DEFAULT_TENANT
        # A window's blocks are rotated as it slides: they are never shared through the prefix cache.
        hashes = (block_hashes(token_ids, self.blocks.block_size, tenant, digest)
                  if self.blocks.enable_prefix_caching and streaming is None else [])
        room = self._room_beside_pins(hashes) if streaming is None else 2**62
        if len(token_ids) >= room:
            raise self._no_room_error(len(token_ids), room)
        if documents is not None:
            documents = self._checked(documents, len(token_ids), params, streaming)
        if documents is not None and digest is None:
            hashes = self._blend(token_ids, documents, tenant, None, None) or hashes
        request = Request(
            request_id=request_id, prompt_token_ids=token_ids, params=params,
            seed=params.seed if params.seed is not None else self._seeds.getrandbits(62),
            arrival=self._arrivals, tenant=tenant, adapter=digest, adapter_name=adapter,
            max_num_tokens=min(len(token_ids) + params.max_tokens, room), block_hashes=hashes,
            streaming=streaming, documents=documents if digest is not None else None,
            is_prefill_only=prefill_only,
        )
        if sample_of is not None and streaming is None:
            request.prompt_donor = self._prompt_donor(request, sample_of)
        if params.structured is not None:
            if grammar is None or grammar.spec != params.structured:
                grammar = self.grammars.compile(params.structured)
            request.matcher = grammar.make_matcher()
            self._constrained.add(request_id)
        self._arrivals += 1
        self._requests[request_id] = request
        if self.tokenizer is not None:
            self._detokenizers[request_id] = Detokenizer(self.tokenizer, token_ids, params.stop)
        self.scheduler.add(request)
        if request.documents is not None:
            self._to_blend.append(request)
        return request

    def _checked(self, documents: DocumentBlend, num_tokens: int, params: SamplingParams,
                 streaming: StreamingWindow | None) -> DocumentBlend | None:
        """The documents to blend, checked (a 400 if out of place), or None for a full prefill:
        the prefix cache is off, the model runs in tensor-parallel workers, the prompt is
        scored (its log-probs need every position computed), or the request keeps a sliding
        window (its blocks are never shared through the prefix cache)."""
        try:
            documents.check(num_tokens)
        except ValueError as error:
            raise InvalidRequestError(str(error), param="documents") from None
        if (not self.blocks.enable_prefix_caching or self.executor is not None
                or params.prompt_logprobs is not None or streaming is not None):
            return None
        return documents

    def _blend_under_adapters(self) -> None:
        """Blend the documents of requests waiting for their adapter's slot whose adapter is in
        one now (a hold on it for the blend; the scheduler takes its own). One that cannot get a
        slot (every slot held, no host room) runs a full prefill; a load under way: next step."""
        waiting = []
        for request in self._to_blend:
            if request.is_finished:
                continue
            acquired = self.adapters.acquire(request.adapter)
            if acquired is Wait.LOADING:
                waiting.append(request)
                continue
            documents, request.documents = request.documents, None
            if isinstance(acquired, Wait):
                continue
            try:
                hashes = self._blend(request.prompt_token_ids, documents, request.tenant, request.adapter,
                                     AdapterSlot(acquired, self.lora))
            finally:
                self.adapters.release(request.adapter)
            if hashes is not None:
                request.block_hashes = hashes
        self._to_blend = waiting

    def _blend(self, token_ids: list[int], documents: DocumentBlend, tenant: str,
               digest: str | None, lora: AdapterSlot | None) -> list[bytes] | None:
        """Blend the prompt's KV from its documents' (computed once each per tenant and adapter)
        into cached blocks that only this request's hashes (returned) name, under `digest`'s
        adapter held in `lora`'s slot (None: the base model). None: nothing blended (no full
        block, or no room), a full prefill."""
        salt = f"{tenant}\x00blend-{self._num_blends}"  # this blend's alone, even if the request then fails
        self._num_blends += 1
        report = prefill_with_documents(self.model, self.kv_cache, self.blocks, token_ids, documents,
                                        tenant, digest, salt, lora)
        if report is None:
            return None
        self.num_document_prefills += report.num_documents_computed
        self.num_blended_prompts += 1
        self.num_blend_reused_tokens += report.num_reused_tokens
        return block_hashes(token_ids, self.blocks.block_size, salt, digest)

    def _prompt_donor(self, request: Request, sample_of: str) -> Request | None:
        donor = self._requests.get(sample_of)
        if (donor is None or donor.prompt_token_ids != request.prompt_token_ids
                or donor.adapter != request.adapter):
            raise InvalidRequestError(f"sample_of: {sample_of!r} is no queued request of the same prompt "
                                      "and adapter", param="sample_of")
        # A sample that scores its prompt computes it all: its log-probabilities come from there.
        return None if request.params.prompt_logprobs is not None else donor

    def _streaming_of(self, params: SamplingParams) -> StreamingWindow | None:
        """The request's attention sinks and window (its own, else the engine's), checked."""
        window = params.streaming_window or self.streaming_window
        if window is not None and (problem := self.window_problem(window)) is not None:
            raise InvalidRequestError(problem, param=window.param)
        return window

    def window_problem(self, window: StreamingWindow) -> str | None:
        """Why the cache cannot hold `window`'s sinks and window, or None if it can."""
        return window_problem(window, self.config.cache.block_size, self.max_model_len)

    def encode_prompt(self, prompt: str | None, prompt_token_ids: list[int] | None,
                      past_context: bool = False) -> list[int]:
        """The prompt's token ids, checked: from `prompt` (text) or `prompt_token_ids`, exactly one.
        `past_context`: it may be longer than the context (attention sinks)."""
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidRequestError("give exactly one of prompt and prompt_token_ids", param="prompt")
        if prompt is not None:
            if self.tokenizer is None:
                raise InvalidRequestError("the model has no tokenizer; pass prompt_token_ids", param="prompt")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            token_ids = list(prompt_token_ids)
        vocab = self.model_config.vocab_size
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        if len(token_ids) >= self.max_model_len and not past_context:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens; this model's context is {self.max_model_len}",
                param="prompt")
        return token_ids

    def abort(self, request_id: str) -> bool:
        """Stop a request; its blocks and adapter slot return at once. False if unknown."""
        request = self._forget(request_id)
        if request is None:
            return False
        self._detokenizers.pop(request_id, None)
        self.scheduler.finish(request, "abort")
        if (key := self._pin_by_request.pop(request_id, None)) is not None:
            self._pins.pop(key, None)  # its warm-up never ended: the next request pins it anew
        if self._orphans:
            self._drop_orphans()
        return True

    def abort_all(self) -> int:
        """Stop every request (after the step in flight, if any, is collected): the engine is
        left idle, every block and slot free (pinned prompts' included). Returns how many were
        stopped."""
        self.drain()
        request_ids = list(self._requests)
        for request_id in request_ids:
            self.abort(request_id)
        for key in list(self._pins):
            self.unpin_prompt(key)
        return len(request_ids)

    def preempt(self, request_id: str) -> bool:
        """Preempt a running request at the next step, as the scheduling policy would: its KV is
        swapped to the host pool (or dropped, to be recomputed) and it waits to resume. False if
        the request is unknown."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        self.scheduler.preempt(request)
        return True

    # The prefix cache and registered system prompts ----------------------------------------
    def reset_prefix_cache(self) -> int:
        """Forget the cached prompt blocks that no request holds (pinned system prompts hold
        theirs and stay); returns how many were dropped. Benchmarks that send a workload again
        call it between runs, so that the second run computes its prompts as the first did."""
        return self.blocks.reset_prefix_cache()

    def pin_prompt(self, key: str, token_ids: list[int], tenant: str | None = None,
                   adapter: str | None = None) -> None:
        """Prefill a system prompt's tokens (under `tenant` and `adapter`, a name or a digest)
        and hold its full KV blocks, so that requests starting with those tokens find them in
        the prefix cache whatever the pressure. Nothing to do if `key` is pinned already; with
        the prefix cache off, nothing at all."""
        if key in self._pins or not self.blocks.enable_prefix_caching:
            return
        digest = self.adapter_digest(adapter) if adapter is not None else None
        request_id = f"pin-{key}"
        self._pins[key] = PinnedPrompt(list(token_ids), tenant or DEFAULT_TENANT, digest)
        self._pin_by_request[request_id] = key
        try:
            self.add_request(request_id, prompt_token_ids=list(token_ids), adapter=adapter, tenant=tenant,
                             params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        except Exception:  # e.g. no room beside the other pins: nothing pinned
            del self._pins[key], self._pin_by_request[request_id]
            raise

    def unpin_prompt(self, key: str) -> None:
        """Let a pinned prompt's blocks go (cached, evictable once nobody else holds them)."""
        pin = self._pins.pop(key, None)
        if pin is not None:
            self.blocks.free(pin.block_ids)
            pin.block_ids = []

    def pinned_prompt(self, key: str) -> PinnedPrompt | None:
        """The pinned prompt under `key` (its blocks empty while its warm-up runs), or None."""
        return self._pins.get(key)

    def pinned_prompts(self) -> dict[str, int]:
        """Each pinned prompt's key -> the KV blocks it holds (0 while its warm-up runs)."""
        return {key: len(pin.block_ids) for key, pin in list(self._pins.items())}

    def _hold_pin(self, request_id: str) -> None:
        """A warm-up request ended (its blocks are cached, nobody holds them): hold the
        prompt's full blocks."""
        pin = self._pins.get(self._pin_by_request.pop(request_id, ""))
        if pin is None or pin.block_ids:
            return
        hashes = block_hashes(pin.token_ids, self.blocks.block_size, pin.tenant, pin.adapter)
        pin.block_ids = self.blocks.match(hashes, len(hashes))
        pin.hashes = hashes[:len(pin.block_ids)]

    def _room_beside_pins(self, hashes: list[bytes]) -> int:
        """Tokens of KV a request whose prompt blocks have these prefix-cache hashes can hold:
        the context, less the blocks pinned prompts hold that its prompt does not start with."""
        pinned = {block_hash for pin in self._pins.values() for block_hash in pin.hashes}  # (a block once)
        if not pinned:
            return self.max_model_len
        own = set(hashes)
        num_apart = sum(block_hash not in own for block_hash in pinned)
        return min(self.max_model_len, (self.memory.num_kv_blocks - num_apart) * self.blocks.block_size)

    def _no_room_error(self, num_prompt_tokens: int, room: int) -> InvalidRequestError:
        return InvalidRequestError(
            f"the prompt has {num_prompt_tokens} tokens; beside the KV blocks that registered system "
            f"prompts hold, the KV cache has room for {room} tokens of this request", param="prompt")

    def _refit_beside_pins(self) -> list[RequestOutput]:
        """A pin took its blocks: a request whose tokens no longer fit fails (it would wait
        forever); the others generate at most what fits (as if the context were that much
        shorter)."""
        failed = []
        for request in list(self._requests.values()):
            if request.request_id in self._pin_by_request or request.streaming is not None:
                continue
            room = self._room_beside_pins(request.block_hashes)
            if request.num_tokens >= room:
                error = self._no_room_error(request.num_prompt_tokens, room)
                failed += self._fail([request.request_id], error)
            else:
                request.max_num_tokens = min(request.max_num_tokens, room)
        return failed

    # Disaggregated prefill (loraplex/engine/disaggregated.py) ----------------------------
    def take_prefilled(self) -> list[PrefilledRequest]:
        """The prefill-only requests that have left this engine since the last call, their first
        token sampled; their block references are the caller's to free."""
        taken, self._prefilled = self._prefilled, []
        return taken

    def admit_prefilled(self, prefilled: PrefilledRequest) -> Request:
        """Queue a request that another engine prefilled, its first token sampled. It waits as a
        swapped request does, its KV on the other engine: admitted, it receives the KV of its
        prompt blocks that this engine has not cached (`receive_kv`) and decodes from its first
        token on, with its sampling state (seed, token index) and its prompt already charged to
        its tenant (with no blocks in `prefilled`, it computes its tokens again here). Raises
        UnknownAdapterError if its adapter is not servable here, InvalidRequestError if it does
        not fit beside the pinned prompts."""
        source = prefilled.request
        if source.request_id in self._requests:
            raise InvalidRequestError(f"request id {source.request_id!r} is already in use",
                                      param="request_id")
        adapter = source.adapter_name or source.adapter
        if source.adapter is not None and self.adapter_digest(adapter) != source.adapter:
            raise UnknownAdapterError(f"adapter {source.adapter_name!r} is not loaded here", param="adapter")
        room = self._room_beside_pins(source.block_hashes)
        if source.num_tokens >= room:
            raise self._no_room_error(source.num_prompt_tokens, room)
        request = Request(
            request_id=source.request_id, prompt_token_ids=source.prompt_token_ids, params=source.params,
            seed=source.seed, arrival=self._arrivals, tenant=source.tenant, adapter=source.adapter,
            adapter_name=source.adapter_name, token_ids=list(source.token_ids),
            max_num_tokens=min(source.max_num_tokens, room), block_hashes=source.block_hashes,
            num_computed_tokens=prefilled.num_cached_tokens, has_remote_kv=bool(prefilled.block_ids),
            num_prompt_charged=source.num_prompt_charged, logprobs=source.logprobs,
            prompt_logprobs=source.prompt_logprobs, matcher=source.matcher,
        )
        self._arrivals += 1
        self._requests[request.request_id] = request
        if prefilled.detokenizer is not None:
            self._detokenizers[request.request_id] = prefilled.detokenizer
        if request.matcher is not None:
            self._constrained.add(request.request_id)
        self.scheduler.add(request)
        return request

    def _receive(self, receive: dict[str, tuple[int, list[int]]]) -> None:
        """Fill admitted prefilled requests' blocks; their full prompt blocks join the prefix
        cache."""
        for request_id, (first, block_ids) in receive.items():
            self.receive_kv(request_id, first, block_ids)
            self.blocks.register(block_ids, self._requests[request_id].block_hashes[first:])
            self.blocks.mark_computed(block_ids)

    def hold_prompt(self, key: str, pin: PinnedPrompt) -> list[RequestOutput]:
        """Pin a system prompt whose full blocks another engine computed: `pin.block_ids` hold
        their KV, cached under `pin.hashes` (references it takes over; freed if `key` is pinned
        already). Returns the outputs of the requests that no longer fit beside it (failed)."""
        if key in self._pins:
            self.blocks.free(pin.block_ids)
            return []
        self._pins[key] = pin
        return self._refit_beside_pins()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._in_flight is not None

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` names a request of this engine (queued or running)."""
        return request_id in self._requests

    # The step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step and return the requests that advanced or finished: this step's, or
        with async scheduling the previous step's, while this one runs on the device."""
        outputs = self._fail_adapter_loads()
        if self._to_blend:
            self.adapters.poll()
            self._blend_under_adapters()
        launched = self.launch(self.scheduler.schedule(), outputs)  # may collect the step in flight
        if self._in_flight is not None:
            outputs += self.collect(self._in_flight)
        self._in_flight = launched
        if launched is not None and not self.async_scheduling:
            self._in_flight = None
            outputs += self.collect(launched)
        if launched is None and self._in_flight is None and not outputs:
            time.sleep(IDLE_WAIT_S)  # only waiting for adapter loads: let their threads run
        return self._without_pins(outputs)

    def _without_pins(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Outputs of callers' requests: pin warm-ups end here, holding their blocks."""
        if not self._pin_by_request:
            return outputs
        kept, has_held = [], False
        for output in outputs:
            if output.request_id not in self._pin_by_request:
                kept.append(output)
            elif output.finished:
                self._hold_pin(output.request_id)
                has_held = True
        return kept + self._refit_beside_pins() if has_held else kept

    def drain(self) -> list[RequestOutput]:
        """Collect the step in flight, if any (afterwards nothing runs on the device)."""
        step, self._in_flight = self._in_flight, None
        return self._without_pins(self.collect(step)) if step is not None else []

    def launch(self, plan: StepPlan, outputs: list[RequestOutput]) -> InFlight | None:
        """Queue a planned step on the device and count its work as done. If the model fails,
        the step's requests fail (their outputs go to `outputs`) and the engine serves on.

        A step that samples a request following a grammar needs its token mask, and the mask
        needs the request's previous token: when the step in flight sampled a constrained request,
        this step's forward pass is queued first, then the step in flight is collected (its
        outputs go to `outputs`; its grammars advance) and the masks filled while the device
        computes, and last the masked draw is queued (ModelRunner.begin / finish)."""
        if not plan.has_work:
            return None
        if plan.receive:
            self._receive(plan.receive)
        try:
            started = self.runner.begin(plan)
        except Exception as exc:
            if is_out_of_memory(exc):
                outputs += self._survive_out_of_memory(plan, exc)
                return None
            logger.exception("engine step failed")
            outputs += self._fail(plan.request_ids, exc)
            return None
        if started is None:  # only records to update or blocks to copy
            return None
        sampling = self.scheduler.advance(plan)
        try:
            if self._constrained and any(r.matcher is not None for r in sampling):
                previous = self._in_flight
                if previous is not None and previous.is_constrained:
                    self._in_flight = None
                    outputs += self.collect(previous)
                plan.token_masks = self._token_masks(plan)
            launched = self.runner.finish(started, plan.token_masks)
        except Exception as exc:
            logger.exception("engine step failed")
            outputs += self._fail(plan.request_ids, exc)
            return None
        self.num_prompt_tokens += plan.num_tokens - len(sampling)
        scored = [r for r in map(self._requests.get, plan.request_ids)
                  if r is not None and r.params.is_scoring_only and r.num_computed_tokens == r.num_tokens]
        return InFlight(plan, sampling, launched, scored)

    def _survive_out_of_memory(self, plan: StepPlan, exc: BaseException) -> list[RequestOutput]:
        """The step ran out of memory: its largest request (and any it swapped in) fails, the
        rest runs again at the next step (see loraplex.engine.out_of_memory)."""
        release_cached_memory(self.device)
        victim = largest_request(plan, self._requests)
        swapped_out, swapped_in = swapped_by(plan, self._requests)
        for request in swapped_out:
            self.scheduler.recompute(request)
        tokens = dict(zip(plan.request_ids, plan.num_scheduled_tokens))
        doomed = ([victim] if victim is not None else []) + [r.request_id for r in swapped_in]
        logger.warning("a step of %d tokens (%d requests) ran out of memory: failed %s, the others run "
                       "again (%s)", plan.num_tokens, len(plan.request_ids), ", ".join(doomed) or "none",
                       str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        return [output for request_id in doomed
                for output in self._fail([request_id], out_of_memory_error(tokens.get(request_id, 0), exc))]

    def _token_masks(self, plan: StepPlan) -> TokenMasks | None:
        """The allowed tokens of the plan's constrained samples, from their matchers (a request
        that ended while the step in flight ran gets none: its token is void)."""
        constrained = [request for request_id, samples in zip(plan.request_ids, plan.samples)
                       if samples and (request := self._requests.get(request_id)) is not None
                       and request.matcher is not None and not request.is_finished]
        if not constrained:
            return None
        bitmask = allocate_masks(len(constrained), self.model_config.vocab_size)
        for row, request in enumerate(constrained):
            request.matcher.fill_mask(bitmask, row)
        return TokenMasks([r.request_id for r in constrained], bitmask)

    def collect(self, step: InFlight) -> list[RequestOutput]:
        """Wait for a launched step's tokens; apply stops and build the outputs."""
        try:
            with self.waiting():
                result = self.runner.collect(step.launched)
        except Exception as exc:
            logger.exception("engine step failed")
            return self._fail([r.request_id for r in step.sampling if not r.is_finished], exc)
        if self._on_step_timed is not None and result.device_s is not None:
            self._on_step_timed(step.plan, result.device_s)
        return self.process(step, result)

    def time_steps(self, on_step: Callable[[StepPlan, float], None] | None) -> None:
        """Call `on_step(plan, device seconds)` as each step is collected (None: stop timing):
        the step's own time on the device, where a step's wall time (with async scheduling, the
        time to collect the step before it) says little about what it planned. Two CUDA events
        a step; a benchmark's instrument (loraplex bench fairness, the synthetic server's step
        log). Engines whose model runs in worker processes do not time their steps."""
        self._on_step_timed = on_step
        self.runner.time_steps = on_step is not None

    def process(self, step: InFlight, result: StepResult) -> list[RequestOutput]:
        """Record a step's tokens, apply stops and build the outputs."""
        self._record_prompt_logprobs(result)
        outputs = []
        for request, token in zip(step.sampling, result.sampled_tokens):
            if request.is_finished:  # stopped or aborted while this step ran: the token is void
                continue
            self.scheduler.commit(request, token)
            self.num_generated_tokens += 1
            outputs.append(self._process(request, result.logprobs.get(request.request_id)))
        for request in step.scored:
            if not request.is_finished:
                outputs.append(self._finish_scoring(request))
        if self._orphans:
            self._drop_orphans()
        return outputs

    def _record_prompt_logprobs(self, result: StepResult) -> None:
        """Append a step's prompt logprobs; entries a request already has (scored again after
        preemption) are dropped."""
        for request_id, (first, entries) in result.prompt_logprobs.items():
            request = self._requests.get(request_id)
            if request is None:
                continue
            have = len(request.prompt_logprobs)
            assert first <= have, "steps score each request's prompt in order"
            request.prompt_logprobs.extend(entries[have - first:])

    def _finish_scoring(self, request: Request) -> RequestOutput:
        """A request that generates nothing ends once its whole prompt is computed."""
        self.scheduler.finish(request, "length")
        self._forget(request.request_id)
        detokenizer = self._detokenizers.pop(request.request_id, None)
        return self._output(request, [], "", detokenizer)

    def _process(self, request: Request, logprob) -> RequestOutput:
        token = request.token_ids[-1]
        params = request.params
        reason: FinishReason | None = None
        new_text, stopped = "", False
        detokenizer = self._detokenizers.get(request.request_id)
        if detokenizer is not None:
            new_text, stopped = detokenizer.push(token)
        grammar_done = False
        if request.matcher is not None:
            if not request.matcher.accept(token):  # the mask allowed it: a bug, not the client's
                return self._fail([request.request_id], RuntimeError(
                    f"the grammar refused token {token} that its own mask allowed"))[0]
            grammar_done = request.matcher.is_done
        if stopped or grammar_done or token in params.stop_token_ids or (
                token in self.eos_token_ids and not params.ignore_eos):
            reason = "stop"
        elif len(request.token_ids) >= request.max_num_tokens:
            reason = "length"
        if logprob is not None:
            request.logprobs.append(logprob)
        if reason is not None:
            self.scheduler.finish(request, reason)
            self._forget(request.request_id)
            if detokenizer is not None:
                new_text += detokenizer.flush()
                self._detokenizers.pop(request.request_id, None)
        output = self._output(request, [token], new_text, detokenizer)
        if reason is None and request.is_prefill_only:
            self._hand_off(request)
        return output

    def _hand_off(self, request: Request) -> None:
        self._forget(request.request_id)
        block_ids = self.scheduler.hand_off(request)
        self._prefilled.append(PrefilledRequest(request, block_ids,
                                                self._detokenizers.pop(request.request_id, None)))

    def _output(self, request: Request, new_ids: list[int], new_text: str,
                detokenizer: Detokenizer | None) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            token_ids=request.output_token_ids,
            text=detokenizer.text if detokenizer is not None else "",
            finished=request.is_finished, finish_reason=request.finish_reason,
            new_token_ids=new_ids, new_text=new_text,
            logprobs=list(request.logprobs) if request.params.logprobs is not None else None,
            prompt_logprobs=request.prompt_logprobs if request.params.prompt_logprobs is not None else None,
            adapter=request.adapter_name,
        )

    def _forget(self, request_id: str) -> Request | None:
        """Drop an ended request from the engine's records (None if it has none)."""
        self._constrained.discard(request_id)
        return self._requests.pop(request_id, None)

    def _fail(self, request_ids: Iterable[str], exc: BaseException) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            request = self._forget(request_id)
            if request is None:
                continue
            detokenizer = self._detokenizers.pop(request_id, None)
            self.scheduler.finish(request, "error")
            output = self._output(request, [], "", detokenizer)
            output.error = f"{type(exc).__name__}: {exc}"
            output.error_code = getattr(exc, "code", None)
            outputs.append(output)
        return outputs

    def _fail_adapter_loads(self) -> list[RequestOutput]:
        """Requests waiting for an adapter whose load failed fail with its error."""
        outputs = []
        for digest, exc in self.adapters.take_failures().items():
            waiting = [r.request_id for r in self._requests.values()
                       if r.adapter == digest and r.status is RequestStatus.WAITING]
            outputs += self._fail(waiting, exc)
        return outputs

    def _eos_ids(self) -> Iterable[int]:
        yield from self.model_config.eos_token_ids
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None:
            yield eos
        generation = Path(self.config.model) / "generation_config.json"  # absent for a given model
        if generation.is_file():
            value = loads_bounded(generation.read_bytes(), MAX_CONFIG_DEPTH).get("eos_token_id")
            yield from value if isinstance(value, list) else [] if value is None else [value]

    def stats(self) -> EngineStats:
        """Live engine state for metrics, the admin API and benchmarks."""
        scheduler, adapters, host = self.scheduler, self.adapters, self.scheduler.host_blocks
        waiting = list(scheduler.policy.waiting())
        swapper = self.runner.swapper
        swaps = swapper.stats() if swapper is not None else SwapStats(0, 0, 0.0, 0.0)
        return EngineStats(
            num_running=len(scheduler.running), num_waiting=scheduler.num_waiting,
            num_kv_blocks=self.memory.num_kv_blocks, num_kv_blocks_used=self.blocks.num_used_blocks,
            num_preemptions=scheduler.num_preemptions, num_lora_slots=adapters.num_slots,
            adapters_in_slots=tuple(adapters.resident), adapters_on_host=adapters.host_digests,
            host_tier_bytes=adapters.host_bytes, max_host_tier_bytes=adapters.max_host_bytes,
            num_adapter_host_loads=adapters.num_host_loads, num_adapter_slot_loads=adapters.num_slot_loads,
            num_generated_tokens=self.num_generated_tokens, num_prompt_tokens=self.num_prompt_tokens,
            running_by_tenant=dict(Counter(r.tenant for r in scheduler.running)),
            waiting_by_tenant=dict(Counter(r.tenant for r in waiting)),
            swapped_by_tenant=dict(Counter(r.tenant for r in waiting if r.is_swapped)),
            tenant_service=scheduler.policy.counters(), tenant_weights=self.tenants.weights,
            preemptions={f"{cause}:{mode}": n for (cause, mode), n in scheduler.preemptions.items()},
            num_host_pool_blocks=host.num_blocks if host else 0,
            num_host_pool_blocks_used=host.num_used_blocks if host else 0,
            swap_bytes_out=swaps.bytes_out, swap_bytes_in=swaps.bytes_in,
            swap_seconds_out=swaps.seconds_out, swap_seconds_in=swaps.seconds_in,
            swap_seconds_stalled=swaps.seconds_stalled,
            running_by_adapter=dict(Counter(r.adapter for r in scheduler.running if r.adapter)),
            waiting_by_adapter=dict(Counter(r.adapter for r in waiting if r.adapter)),
            prefix_queried_tokens=self.blocks.num_queried_tokens,
            prefix_hit_tokens=self.blocks.num_hit_tokens,
            prefix_evicted_blocks=self.blocks.num_evicted_blocks,
            num_shared_kv_blocks=self.blocks.num_shared_blocks,
            num_relay_steps=self.runner.inputs.num_relay_steps,
            num_relay_groups=self.runner.inputs.num_relay_groups,
            num_relay_members=self.runner.inputs.num_relay_members,
            pinned_prompts=self._pin_use(),
            pool_page_bytes=self.memory.kv_block_bytes,
            pool_pages={"kv": self.blocks.num_used_blocks, "adapters": self.blocks.num_lent_blocks,
                        "free": self.blocks.num_free_blocks},
            adapter_device_bytes={d: adapters.device_bytes(d) for d in adapters.resident},
            num_adapter_evictions=adapters.num_evictions, max_loras=self.config.lora.max_loras,
            adapter_wait=scheduler.adapter_wait.copy(),
        )

    def _pin_use(self) -> dict[str, tuple[int, int]]:
        """Each pin's key -> (blocks it holds, running requests that read them: those whose
        first block is the pin's)."""
        firsts = Counter(r.block_ids[0] for r in self.scheduler.running if r.block_ids)
        return {key: (len(pin.block_ids), firsts[pin.block_ids[0]] if pin.block_ids else 0)
                for key, pin in self._pins.items()}

    def close(self) -> None:
        """Stop the adapter loader's threads, and the tensor-parallel workers."""
        self.adapters.close()
        if self.executor is not None:
            self.executor.close()

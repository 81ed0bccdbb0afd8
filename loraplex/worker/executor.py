"""The engine core's side of tensor parallelism: what `LLMEngine` holds in place of its own
model, ModelRunner and slot buffers when `tensor_parallel_size` > 1 (vLLM V1's executor).

The engine keeps everything that decides (scheduler, block manager and prefix cache, adapter
cache, host pool); the workers hold the model's shards, each rank's KV cache (its own heads) and
slots (its adapter shards) in one pool laid out as the engine would lay out its own, and run
every step plan on every rank. So block and slot ids mean the same on the engine and on every
rank, swaps move each rank's part of a block, and nothing but plans, adapter tensors and
sampled tokens crosses the pipes.

- `RemoteRunner` has ModelRunner's step interface (`begin`, `finish`, `collect`, `on_logits`,
  the relay and swap counters): a step's plan goes to the workers at `finish`, once its token
  masks are known; `collect` returns rank 0's tokens.
- `RemoteSlots` has the slot buffers' interface that the adapter cache uses: `load` only queues
  the adapter, and the next step sends it ahead of itself (the ranks run commands in order, so
  the load lands after the steps launched before it, which may still read the slot's old
  adapter, and before any step that reads the new one). The adapter cache's copy thread calls
  `load`; only the engine thread writes to the pipes."""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from loraplex.engine.adapter_pages import adapter_page_blocks
from loraplex.engine.kv_swap import KvSwapper, SwapStats
from loraplex.engine.lora_weights import (
    HostAdapter,
    LoraSlotBuffers,
    adapter_pages_for,
    max_adapter_pool_bytes,
)
from loraplex.engine.plan import StepPlan, StepResult, TokenMasks
from loraplex.engine.sizing import MemoryPlan, kv_block_bytes, plan_memory
from loraplex.engine.staging import Runs
from loraplex.engine_config import EngineConfig
from loraplex.model.model_config import ModelConfig
from loraplex.parallel.sharding import ShardLayout
from loraplex.worker.adapters import packed_for_the_wire
from loraplex.worker.commands import RunnerSpec
from loraplex.worker.replies import RunnerCounters
from loraplex.worker.workers import TensorParallelWorkers, check_workers

logger = logging.getLogger(__name__)


@dataclass
class _Started:
    plan: StepPlan


@dataclass
class _Launched:
    sampled_ids: list[str] = field(default_factory=list)
    is_sent: bool = False


class RemoteRunner:
    """ModelRunner's step interface over the workers."""

    def __init__(self, workers: TensorParallelWorkers, slots: RemoteSlots) -> None:
        self.workers, self.slots = workers, slots
        self.on_logits: Any = None
        """Called at collect with the sampled ids and rank 0's logits (tests, benchmarks)."""
        self.graphs = None  # the workers capture their own
        self._counters = RunnerCounters()

    def begin(self, plan: StepPlan) -> _Started | None:
        """Send the adapter loads queued since the last step; a plan that computes nothing
        (records to update, blocks to swap) goes to the workers at once, its reply unread."""
        self.workers.read_acknowledgements()
        self.slots.send_queued()
        if plan.is_empty:
            self.workers.launch(plan, want_reply=False)
            return None
        return _Started(plan)

    def finish(self, started: _Started | None, masks: TokenMasks | None) -> _Launched:
        if started is None:
            return _Launched()
        plan = started.plan
        if masks is not plan.token_masks:
            plan = dataclasses.replace(plan, token_masks=masks)
        self.workers.launch(plan, return_logits=self.on_logits is not None)
        return _Launched([r for r, s in zip(plan.request_ids, plan.samples) if s], is_sent=True)

    def launch(self, plan: StepPlan) -> _Launched:
        return self.finish(self.begin(plan), plan.token_masks)

    def collect(self, launched: _Launched) -> StepResult:
        """Rank 0's tokens of a launched step (steps are collected in launch order)."""
        if not launched.is_sent:
            return StepResult()
        output = self.workers.collect()
        if output.counters is not None:
            self._counters = output.counters
        if self.on_logits is not None and output.logits is not None:
            self.on_logits(launched.sampled_ids, output.logits)
        return output.result

    @property
    def inputs(self) -> RunnerCounters:
        """Rank 0's relay counters (the attributes the engine's stats read of StepInputs)."""
        return self._counters

    @property
    def swapper(self) -> _SwapCounters | None:
        swap = self._counters.swap
        return None if swap is None else _SwapCounters(swap)


@dataclass(frozen=True)
class _SwapCounters:
    swap: SwapStats

    def stats(self) -> SwapStats:
        return self.swap


ADAPTER_RING_ADAPTERS = 4
"""Adapters of the largest rank that a one-rank worker's adapter ring holds at once (loads
written and not yet copied out; one past it waits for room or takes the slower path)."""


class RemoteSlots:
    """The adapter cache's slot buffers, on the workers."""

    def __init__(self, workers: TensorParallelWorkers, num_slots: int, shard: ModelConfig,
                 dtype: torch.dtype, block_bytes: int, max_rank: int, ring_bytes: int = 0) -> None:
        """`ring_bytes`: with one rank, an adapter ring of that size (rounded down to whole pool
        pages) shared with it (MapAdapterRing); 0: none."""
        self.workers, self.num_slots = workers, num_slots
        self.blocks_per_page = adapter_page_blocks(shard, dtype, block_bytes)
        self.page_bytes = self.blocks_per_page * block_bytes
        self._shard, self._dtype = shard, dtype
        self._packer = None if workers.world_size > 1 else LoraSlotBuffers(
            shard, 0, max_rank, dtype, torch.device("cpu"), block_bytes=block_bytes)
        """With one rank: lays adapters out as its pool's pages, here (`prepare`)."""
        self.device = torch.device("cpu")  # the engine core copies nothing to a device itself
        self._queued: list[tuple[int, HostAdapter, list[int], tuple[int, int] | None]] = []
        self._lock = threading.Lock()
        self._ring: torch.Tensor | None = None
        self._ring_runs = Runs(0)
        """Free pages of the ring (its own page-sized units)."""
        num_ring_pages = ring_bytes // self.page_bytes if self._packer is not None else 0
        if num_ring_pages:
            self._ring = torch.zeros(num_ring_pages * self.page_bytes, dtype=torch.uint8).share_memory_()
            workers.map_adapter_ring(self._ring)
            self._ring_runs = Runs(num_ring_pages)
        self.num_ring_loads = 0
        """Loads whose pages went through the ring (the others: a shared segment each, or whole)."""

    def pages_for(self, adapter: HostAdapter) -> int:
        """Pool pages the adapter takes on every rank (the shard's dims; a rank's shard of an
        IA3 adapter may use fewer)."""
        return adapter_pages_for(self._shard, self._dtype, self.page_bytes, adapter)

    def prepare(self, host: HostAdapter) -> None:
        """(The adapter cache's load thread.) With one rank, lay the adapter out as its pool's
        pages here, once, in shared memory: a load then sends the pages' handle, without A and B,
        and the worker only copies them (an adapter pickled through the pipe and packed there
        took 72-119 ms of the worker's time on an H200: studies/adapter_load_workers.py).
        With more ranks each packs its own shard."""
        if self._packer is not None:
            packed = self._packer.prepare(host)
            if not packed.pages.is_shared():
                packed.pages.share_memory_()

    def _is_packed(self, adapter: HostAdapter) -> bool:
        """Whether a load sends the adapter's packed pages without A and B (the rank's load reads
        neither then; DoRA's row norms do, so it goes whole)."""
        return (self._packer is not None and adapter.family != "dora"
                and self._packer.pack_key in adapter.packed)

    def _sent(self, adapter: HostAdapter) -> HostAdapter:
        """What a load sends outside the ring: packed (packed_for_the_wire) where it may be."""
        return packed_for_the_wire(adapter, self._packer.pack_key) if self._is_packed(adapter) else adapter

    def load(self, slot: int, adapter: HostAdapter, pages: list[int]) -> None:
        """Queue `adapter` for `slot` and its pool `pages` (the adapter cache's copy thread); the
        next step sends it. Its packed pages are written into the ring here, where there is room."""
        ring = self._write_to_ring(adapter)
        with self._lock:
            self._queued.append((slot, adapter, pages, ring))

    def _write_to_ring(self, adapter: HostAdapter) -> tuple[int, int] | None:
        """(first ring page, pages) where the adapter's packed pages now are, or None (no ring,
        not packed, or no room)."""
        if self._ring is None or not self._is_packed(adapter):
            return None
        packed = adapter.packed[self._packer.pack_key].pages
        count = packed.numel() // self.page_bytes
        with self._lock:
            first = self._ring_runs.take(count) if count else None
        if first is None:
            return None
        self._ring[first * self.page_bytes:(first + count) * self.page_bytes].copy_(packed)
        return first, count

    def _free_ring(self, run: tuple[int, int]) -> None:
        with self._lock:
            self._ring_runs.give_back(*run)

    @property
    def ring_free_bytes(self) -> int:
        with self._lock:
            return self._ring_runs.num_free_blocks * self.page_bytes

    def send_queued(self) -> None:
        """Send the queued loads to the workers (the engine thread, before a step)."""
        with self._lock:
            queued, self._queued = self._queued, []
        for slot, adapter, pages, ring in queued:
            if ring is None:
                self.workers.queue_adapter(slot, self._sent(adapter), pages)
                continue
            first, count = ring
            self.workers.queue_adapter(
                slot, packed_for_the_wire(adapter, self._packer.pack_key, pages_in_ring=True), pages,
                ring=(first * self.page_bytes, count * self.page_bytes),
                on_done=lambda _answer, run=ring: self._free_ring(run))
            self.num_ring_loads += 1


@dataclass
class TensorParallelExecutor:
    """The workers of one engine, their memory plan, and the runner and slots in front of them."""

    workers: TensorParallelWorkers
    memory: MemoryPlan
    runner: RemoteRunner
    slots: RemoteSlots
    num_host_blocks: int

    @classmethod
    def start(cls, config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
              max_model_len: int, random_weights: bool = False,
              workers: TensorParallelWorkers | None = None) -> TensorParallelExecutor:
        """Check the split (before any process starts or weight is read), spawn the workers
        (or take `workers`, spawned already: spawn_disaggregated), size the rank's pool (on CUDA
        from every rank's measured budget, the smallest), and have every rank build its shard
        and runner."""
        size = config.tensor_parallel_size if workers is None else workers.world_size
        check_workers(model_config, size, device)
        shard = ShardLayout(model_config, 0, size).shard_config  # every rank's sizes
        if workers is None:
            cuda = device.type == "cuda"
            workers = TensorParallelWorkers(size, backend="nccl" if cuda else "gloo",
                                            num_threads=torch.get_num_threads() if cuda else 1)
        try:
            spec = RunnerSpec(
                model=config.model, dtype=str(dtype).removeprefix("torch."), device=device.type,
                kernels=config.kernels, max_model_len=max_model_len, block_size=config.cache.block_size,
                max_lora_rank=config.lora.max_lora_rank, max_num_seqs=config.scheduler.max_num_seqs,
                max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                relay_attention=config.relay_attention,
                use_cuda_graphs=device.type == "cuda" and not config.enforce_eager,
                flora_graphs=config.lora.flora_graphs, random_weights=random_weights, seed=config.seed)
            budget, activations, graphs = config.cache.cpu_kv_cache_bytes, 0, 0
            reports = [r for r in workers.measure_memory(spec, config.cache.gpu_memory_utilization) if r]
            if reports:  # CUDA: the rank with the least room sizes every rank's pool
                budget = min(r.budget_bytes for r in reports)
                activations = max(r.activation_bytes for r in reports)
                graphs = max(r.graph_bytes for r in reports)
            page_bytes = kv_block_bytes(shard, config.cache.block_size, dtype)
            slot_bytes = max_adapter_pool_bytes(shard, config.lora.max_lora_rank, dtype, page_bytes)
            memory = plan_memory(config, shard, dtype, max_model_len, slot_bytes, budget, activations, graphs)
            num_host_blocks = KvSwapper.host_blocks_for(config.cache.swap_space, memory.kv_block_bytes)
            workers.load_model(dataclasses.replace(
                spec, num_kv_blocks=memory.num_pool_blocks, num_lora_slots=memory.num_lora_slots,
                lora_slot_bytes=memory.lora_slot_bytes, num_host_blocks=num_host_blocks))
        except BaseException:
            workers.close()
            raise
        logger.info("%d worker process%s (%s); each rank's %s", size, "es" if size > 1 else "",
                    workers.backend, memory.describe())
        slots = RemoteSlots(workers, memory.num_lora_slots, shard, dtype, memory.kv_block_bytes,
                            config.lora.max_lora_rank, ring_bytes=ADAPTER_RING_ADAPTERS * slot_bytes)
        return cls(workers, memory, RemoteRunner(workers, slots), slots, num_host_blocks)

    def close(self) -> None:
        self.workers.close()

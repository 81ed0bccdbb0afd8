"""A worker process: rank `rank` of a tensor-parallel group. It joins the group, then answers
the driver's commands in order, one reply each, until Shutdown or until the driver's end of
the pipe closes. Every rank runs every step (the collectives need them all) and keeps its own
runner records; rank 0 returns the sampled tokens."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import time
import traceback
from datetime import timedelta
from functools import partial
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from loraplex.engine.lora_weights import HostAdapter, LoraSlotBuffers, PackedAdapter
from loraplex.engine.model_runner import ModelRunner, measure_step_bytes
from loraplex.engine.relay_groups import RelayRule
from loraplex.engine.sizing import cuda_budget, kv_cache_view, resolve_dtype
from loraplex.kernels import select_ops
from loraplex.model.model_config import ModelConfig
from loraplex.parallel.collectives import TensorParallelGroup
from loraplex.parallel.loader import load_model_shard
from loraplex.parallel.model import ParallelLlamaForCausalLM
from loraplex.parallel.sharding import ShardLayout
from loraplex.worker.adapters import dora_row_scales, shard_host_adapter
from loraplex.worker.commands import (
    Command,
    LoadAdapter,
    LoadModel,
    MapAdapterRing,
    MapPeerKv,
    MeasureMemory,
    PushKv,
    ReceiveKv,
    RunnerSpec,
    RunStep,
    ShareKv,
    Shutdown,
    TimeCollectives,
)
from loraplex.worker.peer_copy import copy_to_peer, enable_peer_access
from loraplex.worker.replies import (
    Done,
    Failed,
    KvHandle,
    KvReceived,
    MemoryReport,
    RunnerCounters,
    StepOutput,
)

logger = logging.getLogger(__name__)

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                    "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast off in NCCL, PyTorch's symmetric memory and NVSHMEM, in every worker: on
the lent machines it can put a shared host's GPUs out of service (issue 22)."""


def run_worker(rank: int, world_size: int, init_method: str, conn: Connection, timeout_s: float,
               num_threads: int, backend: str = "gloo",
               tensor_parallel: tuple[int, int] | None = None, share_kv: bool = False) -> None:
    """The process's entry point (spawned by TensorParallelWorkers). `rank` of `world_size` in
    the process group; with NCCL, rank r runs on cuda:r. `tensor_parallel`: (its rank, the
    size) of the model's tensor-parallel group (default: the whole process group); a group of
    its own only of size 1 (disaggregated prefill and decode: every worker holds a whole model,
    the process group carries the KV between them). `share_kv`: keep the KV cache where another
    worker can map it (ShareKv; on CPU a file under /dev/shm), and so any staging area."""
    os.environ.update(NO_MULTICAST_ENV)
    torch.set_num_threads(num_threads)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s),
                            **({"device_id": device} if backend == "nccl" else {}))
    tp_rank, tp_size = tensor_parallel or (rank, world_size)
    if tp_size not in (1, world_size):
        raise NotImplementedError("a tensor-parallel group smaller than the process group, but of 1")
    worker = Worker(TensorParallelGroup(tp_rank, tp_size), device, share_kv)
    try:
        while True:
            try:
                command = conn.recv()
            except (EOFError, OSError):  # the driver is gone
                return
            if isinstance(command, Shutdown):
                conn.send(Done(rank))
                return
            try:
                reply = Done(rank, worker.handle(command))
            except Exception:  # noqa: BLE001 (the driver re-raises it, with the rank)
                reply = Failed(rank, traceback.format_exc())
            conn.send(reply)
    finally:
        worker.unlink_shared()
        dist.destroy_process_group()


class Worker:
    """One rank's model shard, KV cache, adapter slots and runner."""

    def __init__(self, group: TensorParallelGroup, device: torch.device | None = None,
                 share_kv: bool = False) -> None:
        self.group = group
        self.device = device or torch.device("cpu")
        """The rank's device: cpu (gloo) or cuda:rank (NCCL)."""
        self.share_kv = share_kv
        self._shared_paths: dict[str, str] = {}  # "kv" / "staging" -> its /dev/shm file (CPU)
        self.staging: torch.Tensor | None = None
        """This rank's staging area (ShareKv with staging_blocks): peers push blocks into it."""
        self.peer_kv: torch.Tensor | None = None
        """A peer worker's KV cache, mapped (MapPeerKv): what ReceiveKv copies from."""
        self.peer_staging: torch.Tensor | None = None
        """A peer worker's staging area, mapped (MapPeerKv, staging): what PushKv copies into."""
        self._direct_push = False  # pushes as one cudaMemcpyAsync (peer_copy.py)
        self.adapter_ring: torch.Tensor | None = None
        """Host memory the driver writes packed adapters into (MapAdapterRing; pinned on a GPU)."""
        self._ring_pinned = False
        self.layout: ShardLayout | None = None
        self.model: ParallelLlamaForCausalLM | None = None
        self._model_key: tuple | None = None  # what the loaded shard was built from
        self.runner: ModelRunner | None = None

    def handle(self, command: Command) -> object:
        if isinstance(command, LoadModel):
            return self.load_model(command.spec)
        if isinstance(command, MeasureMemory):
            return self.measure_memory(command.spec, command.gpu_memory_utilization)
        if self.runner is None:
            raise RuntimeError(f"{type(command).__name__} before LoadModel")
        if isinstance(command, LoadAdapter):
            self.load_adapter(command.slot, command.adapter, command.pages, command.ring)
            return None
        if isinstance(command, MapAdapterRing):
            self.map_adapter_ring(command.ring)
            return None
        if isinstance(command, RunStep):
            return self.run_step(command)
        if isinstance(command, TimeCollectives):
            return self.time_collectives(command)
        if isinstance(command, ShareKv):
            return self.shared_kv(command.staging_blocks)
        if isinstance(command, MapPeerKv):
            return self.map_peer_kv(command.handle, command.staging)
        if isinstance(command, PushKv):
            return self.push_kv(command)
        if isinstance(command, ReceiveKv):
            return self.receive_kv(command)
        raise TypeError(f"unknown command {command!r}")

    def _load_shard(self, spec: RunnerSpec) -> ParallelLlamaForCausalLM:
        """The rank's model shard of `spec` (the one loaded already, if built from the same)."""
        device = torch.device(spec.device)
        if device.type != self.device.type:
            raise ValueError(f"a {spec.device} model on workers of device {self.device}")
        key = (spec.model, spec.dtype, spec.kernels, spec.max_model_len, spec.random_weights, spec.seed)
        if self.model is not None and self._model_key == key:
            return self.model
        self.runner, self.model = None, None  # the old shard's memory goes before the new one is read
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        dtype = resolve_dtype(spec.dtype, self.device)
        layout = ShardLayout(ModelConfig.load(spec.model), self.group.rank, self.group.world_size)
        ops = select_ops(self.device, spec.kernels, check_inputs=False)
        if spec.random_weights:
            self.model = random_shard(layout, ops, dtype, self.device, spec.max_model_len, self.group,
                                      spec.seed)
        else:
            self.model = load_model_shard(spec.model, layout, ops, dtype, self.device, spec.max_model_len,
                                          self.group)
        self.layout, self._model_key = layout, key
        return self.model

    def measure_memory(self, spec: RunnerSpec, gpu_memory_utilization: float) -> MemoryReport | None:
        """Load the shard and measure a step's activations (and decode graphs) beside it."""
        model = self._load_shard(spec)
        if self.device.type != "cuda":
            return None
        shard = self.layout.shard_config
        block = (shard.num_layers, 2, spec.block_size, shard.num_kv_heads, shard.head_dim)
        activations, graphs = measure_step_bytes(
            model, model.ops, block, spec.max_lora_rank, spec.max_num_seqs, spec.max_num_batched_tokens,
            spec.max_model_len, spec.use_cuda_graphs)
        budget = cuda_budget(gpu_memory_utilization, self.device, activations, graphs)
        return MemoryReport(budget, activations, graphs)

    def load_model(self, spec: RunnerSpec) -> dict[str, tuple[int, ...]]:
        """Build the rank's shard (or keep the one loaded) and its runner; returns the shard's
        parameter shapes."""
        self.runner = None  # its KV cache and slots go before new ones are made
        model = self._load_shard(spec)
        dtype, device, shard = model.norm.dtype, self.device, self.layout.shard_config
        if spec.lora_slot_bytes:  # one pool: the KV blocks and the slots, as the engine's own
            block_bytes = (shard.num_layers * 2 * spec.block_size * shard.num_kv_heads * shard.head_dim
                           * torch.empty((), dtype=dtype).element_size())
            pool = self._zeros((spec.num_kv_blocks * block_bytes,), torch.uint8)
            kv_cache = kv_cache_view(pool, shard, spec.block_size, dtype)
            lora = LoraSlotBuffers(shard, spec.num_lora_slots, spec.max_lora_rank, dtype, device,
                                   base_weights=model.group_weights, pool=pool, block_bytes=block_bytes)
        else:
            kv_cache = self._zeros((spec.num_kv_blocks, shard.num_layers, 2, spec.block_size,
                                    shard.num_kv_heads, shard.head_dim), dtype)
            lora = LoraSlotBuffers(shard, spec.num_lora_slots, spec.max_lora_rank, dtype, device,
                                   base_weights=model.group_weights)
        self.runner = ModelRunner(model, kv_cache, lora, model.ops, spec.max_num_seqs,
                                  spec.max_num_batched_tokens, spec.max_model_len,
                                  use_cuda_graphs=spec.use_cuda_graphs,
                                  num_host_blocks=spec.num_host_blocks, flora_graphs=spec.flora_graphs,
                                  relay=RelayRule(spec.relay_attention))
        if self.runner.graphs is not None:  # every rank captures the same graphs in the same order
            self.runner.graphs.capture_all()
        if device.type == "cuda":
            self.runner.warm_up(spec.max_num_batched_tokens)
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        shapes["kv_cache"] = tuple(kv_cache.shape)
        return shapes

    def map_adapter_ring(self, ring: torch.Tensor) -> None:
        """Keep the driver's adapter ring, pinned (page-locked where it lies) on a GPU."""
        self._unpin_adapter_ring()
        self.adapter_ring = ring
        if self.device.type == "cuda" and ring.numel():
            error = torch.cuda.cudart().cudaHostRegister(ring.data_ptr(), ring.numel(), 0)
            if int(error) != 0:  # (it still works, from pageable memory)
                logger.warning("could not pin the adapter ring (%d bytes): cudaError %d", ring.numel(),
                               int(error))
            self._ring_pinned = int(error) == 0

    def _unpin_adapter_ring(self) -> None:
        if self.adapter_ring is not None and self._ring_pinned:
            torch.cuda.cudart().cudaHostUnregister(self.adapter_ring.data_ptr())
        self._ring_pinned = False

    def load_adapter(self, slot: int, adapter: HostAdapter, pages: tuple[int, ...] | None = None,
                     ring: tuple[int, int] | None = None) -> None:
        """Copy the rank's shard of `adapter` into `slot` (its packed pages from the adapter ring
        at `ring`, where given: the copy is done when this returns); a DoRA adapter's o and down
        scales are then set from its row norms over every rank's columns."""
        shard, lora = shard_host_adapter(adapter, self.layout), self.runner.lora
        if not 0 < slot <= lora.num_slots:  # (before its pages are counted)
            raise ValueError(f"slot {slot} out of range 1..{lora.num_slots}")
        if (ring is not None or (shard.packed and not shard.a)) and lora.pack_key not in shard.packed:
            raise ValueError(f"adapter {adapter.digest} came packed, without A and B, for another layout "
                             "than this rank's")  # (RemoteSlots._sent)
        if ring is not None:  # its packed pages are in the ring
            at, size = ring
            if self.adapter_ring is None or at < 0 or at + size > self.adapter_ring.numel():
                raise ValueError(f"adapter {adapter.digest} is at [{at}, {at + size}) of an adapter ring of "
                                 f"{0 if self.adapter_ring is None else self.adapter_ring.numel()} bytes")
            tables = shard.packed[lora.pack_key].tables
            shard.packed[lora.pack_key] = PackedAdapter(self.adapter_ring[at:at + size], tables)
        if pages is None:  # the rank's adapters have a pool of their own
            pages = lora.own_pages_of(slot, lora.pages_for(shard))
        lora.load(slot, shard, list(pages))
        if ring is not None and self.device.type == "cuda":  # the driver writes there again next
            torch.cuda.current_stream(self.device).synchronize()
        if shard.family != "dora":
            return
        base_weights = self.runner.model.group_weights
        for name, scale in dora_row_scales(shard, base_weights, self.group).items():
            # o's bias: y <- scale (W0 x + delta) + bias (rank 0 holds it)
            lora.set_row_scale(slot, name, scale)

    def run_step(self, command: RunStep) -> StepOutput | None:
        runner, logits = self.runner, []
        if (command.plan.swap_out or command.plan.swap_in) and runner.swapper is None:
            raise ValueError("the plan swaps KV blocks, but the workers have no host pool "
                             "(num_host_blocks 0)")
        is_driver_rank = self.group.rank == 0
        runner.on_logits = (lambda ids, step_logits: logits.append(step_logits.clone())) \
            if command.return_logits and is_driver_rank else None
        result = runner.collect(runner.launch(command.plan))
        if not is_driver_rank:
            return None
        inputs, swapper = runner.inputs, runner.swapper
        counters = RunnerCounters(inputs.num_relay_steps, inputs.num_relay_groups, inputs.num_relay_members,
                                  swapper.stats() if swapper is not None else None)
        return StepOutput(result, logits[0].cpu() if logits else None, counters)

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype, kind: str = "kv") -> torch.Tensor:
        """A zeroed KV cache (or pool, or staging area): shareable on CPU where `share_kv` asks
        (a new file under /dev/shm, mapped; the last one's of the same kind goes)."""
        if not (self.share_kv and self.device.type == "cpu"):
            return torch.zeros(shape, dtype=dtype, device=self.device)
        self._unlink(kind)
        path = self._shared_paths[kind] = f"/dev/shm/loraplex-{kind}-{os.getpid()}-{time.monotonic_ns()}"
        return torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype).view(shape)

    def _unlink(self, kind: str) -> None:
        path = self._shared_paths.pop(kind, "")
        if path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def unlink_shared(self) -> None:
        """Remove the shareable memory's file names (their mappings live on)."""
        for kind in list(self._shared_paths):
            self._unlink(kind)

    def shared_kv(self, staging_blocks: int = 0) -> KvHandle:
        """The KV cache, or a staging area of `staging_blocks` made now, as another process maps
        it (CUDA IPC, or the file of CPU memory)."""
        kv_cache, kind = self.runner.kv_cache, "kv"
        if staging_blocks:
            kind = "staging"
            self.staging = self._zeros((staging_blocks, *kv_cache.shape[1:]), kv_cache.dtype, kind)
        shared = self.staging if staging_blocks else kv_cache
        dtype = str(shared.dtype).removeprefix("torch.")
        if shared.device.type == "cuda":
            rebuild, args = reduce_tensor(shared)
            return KvHandle("cuda", tuple(shared.shape), dtype, cuda_ipc=pickle.dumps((rebuild, args)))
        if kind not in self._shared_paths:
            raise RuntimeError("this worker's memory cannot be shared: on CPU only workers started with "
                               "share_kv keep it in files")
        return KvHandle("cpu", tuple(shared.shape), dtype, path=self._shared_paths[kind])

    def map_peer_kv(self, handle: KvHandle, staging: bool = False) -> None:
        """Map a peer's KV cache, or (`staging`) its staging area (its ShareKv reply); a CPU
        file's name then goes (both processes hold mappings)."""
        if handle.device == "cuda":
            rebuild, args = pickle.loads(handle.cuda_ipc)
            mapped = rebuild(*args)
        else:
            mapped = torch.from_file(handle.path, shared=True, size=math.prod(handle.shape),
                                     dtype=getattr(torch, handle.dtype)).view(handle.shape)
            os.unlink(handle.path)
        kv_cache = self.runner.kv_cache
        if mapped.shape[1:] != kv_cache.shape[1:] or mapped.dtype != kv_cache.dtype:
            raise ValueError(f"the peer's KV blocks are {tuple(mapped.shape[1:])} {handle.dtype}; this "
                             f"rank's {tuple(kv_cache.shape[1:])} {kv_cache.dtype}")
        if staging:
            self.peer_staging = mapped
            if mapped.device.type == "cuda":
                self._direct_push = enable_peer_access(kv_cache.device, mapped.device)
        else:
            self.peer_kv = mapped

    def push_kv(self, command: PushKv) -> KvReceived:
        """Gather the blocks here, copy them into the peer's staging area in one copy; timed
        from the gather to the last byte (this device synchronized: the copy runs on its stream)."""
        kv_cache, staging = self.runner.kv_cache, self.peer_staging
        if staging is None:
            raise RuntimeError("PushKv before MapPeerKv of a staging area")
        end = command.offset + len(command.block_ids)
        if not 0 <= command.offset <= end <= staging.shape[0]:
            raise ValueError(f"blocks [{command.offset}, {end}) out of the staging area's {staging.shape[0]}")
        started = time.perf_counter()
        ids = torch.tensor(command.block_ids, dtype=torch.long, device=kv_cache.device)
        blocks = kv_cache.index_select(0, ids)
        if kv_cache.device.type == "cuda":
            copy_to_peer(staging[command.offset:end], blocks, self._direct_push)
        else:
            staging[command.offset:end].copy_(blocks)
        if kv_cache.device.type == "cuda":
            torch.cuda.synchronize(kv_cache.device)
        return KvReceived(blocks.numel() * blocks.element_size(), time.perf_counter() - started)

    def receive_kv(self, command: ReceiveKv) -> KvReceived:
        """Copy blocks into this rank's: from its own staging area (local), or out of the peer's
        cache (gathered on the peer's device, one copy across, scattered here); timed to the last
        byte (the device synchronized)."""
        source, kv_cache = (self.staging if command.from_staging else self.peer_kv), self.runner.kv_cache
        if source is None:
            raise RuntimeError("ReceiveKv before its source was made or mapped (ShareKv, MapPeerKv)")
        if len(command.source_ids) != len(command.target_ids):
            raise ValueError(f"{len(command.source_ids)} source blocks for {len(command.target_ids)} targets")
        started = time.perf_counter()
        sources = torch.tensor(command.source_ids, dtype=torch.long, device=source.device)
        blocks = source.index_select(0, sources).to(kv_cache.device)
        targets = torch.tensor(command.target_ids, dtype=torch.long, device=kv_cache.device)
        kv_cache.index_copy_(0, targets, blocks)
        if kv_cache.device.type == "cuda":
            torch.cuda.synchronize(kv_cache.device)
        return KvReceived(blocks.numel() * blocks.element_size(), time.perf_counter() - started)

    def time_collectives(self, command: TimeCollectives) -> list[dict[str, float]] | None:
        config, group, device = self.layout.config, self.group, self.device
        dtype, rows = self.model.norm.dtype, []
        num_reduces = 2 * config.num_layers + 1
        for batch in command.batch_sizes:
            hidden = torch.ones(batch, config.hidden_size, dtype=dtype, device=device)
            logits = torch.ones(batch, self.layout.vocab_rows, dtype=torch.float32, device=device)
            reduce_s = _time(partial(group.all_reduce, hidden), device, command.iterations)
            gather_s = _time(partial(group.all_gather_columns, logits), device, command.iterations)
            row = {"batch": batch, "all_reduce_us": round(reduce_s * 1e6, 2),
                   "all_reduces_per_step": num_reduces, "logits_all_gather_us": round(gather_s * 1e6, 2),
                   "step_ms": round((num_reduces * reduce_s + gather_s) * 1e3, 3)}
            if device.type == "cuda":  # as a decode step replays them: in one CUDA graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(num_reduces):
                        group.all_reduce(hidden)
                    group.all_gather_columns(logits)
                row["graph_step_ms"] = round(_time(graph.replay, device, command.iterations) * 1e3, 3)
            rows.append(row)
        return rows if group.rank == 0 else None


def _time(fn, device: torch.device, iterations: int) -> float:
    """Seconds a call of `fn` takes, on average (after 5 unmeasured)."""
    for _ in range(5):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(iterations):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / iterations


@torch.no_grad()
def random_shard(layout: ShardLayout, ops, dtype: torch.dtype, device: torch.device, max_positions: int,
                 group: TensorParallelGroup, seed: int) -> ParallelLlamaForCausalLM:
    """A shard of random weights, N(0, 0.02), norms 1 (benchmarks: a step costs the same whatever
    the values)."""
    with torch.device("meta"):
        model = ParallelLlamaForCausalLM(layout, ops, max_positions, group)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed * 1009 + layout.rank)
    for name, param in model.named_parameters():
        param.data = param.data.to(dtype)
        if name.endswith("norm"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)
    model.reset_rope()
    return model.eval()

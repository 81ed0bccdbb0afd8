"""What the driver sends to every worker (plain, picklable data)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from loraplex.engine.lora_weights import HostAdapter
from loraplex.engine.plan import StepPlan
from loraplex.worker.replies import KvHandle


@dataclass(frozen=True)
class RunnerSpec:
    """A model and the runner around it, as every rank builds its shard of them. Sizes come
    from the driver's memory plan, so that its block and slot ids mean the same on every rank."""

    model: str
    """A local Hugging Face model folder."""
    dtype: str = "float32"
    """"float32", "bfloat16" or "float16"."""
    device: str = "cpu"
    """"cpu" (gloo), or "cuda" (NCCL, rank r on GPU r)."""
    kernels: str = "auto"
    """The op set (EngineConfig.kernels)."""
    max_model_len: int = 512
    num_kv_blocks: int = 64
    """KV blocks a rank's cache has: the driver's block id space, its pool's pages (the driver
    hands KV blocks out of one pool with the adapter slots; a rank's slots have memory of their
    own for now, so the pages that adapters take there stay unused in a rank's cache)."""
    block_size: int = 16
    num_lora_slots: int = 4
    max_lora_rank: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    relay_attention: Literal["auto", "always", "off"] = "auto"
    num_host_blocks: int = 0
    """The host pool that preempted requests' KV is swapped to (each rank swaps its shard of a
    block); 0: none, and a plan that swaps is refused."""
    lora_slot_bytes: int = 0
    """Bytes an adapter slot takes in the rank's pool (whole KV blocks of the rank's shard, as
    the engine's memory plan of the shard config says): the rank's KV cache and slots then
    share one pool, laid out as the single-process engine lays out its own, slot s on blocks
    [s * slot_blocks, (s + 1) * slot_blocks). 0: the slots have memory of their own."""
    use_cuda_graphs: bool = False
    """Capture the decode steps as CUDA graphs on every rank, the collectives inside them."""
    flora_graphs: bool = False
    random_weights: bool = False
    """Fill the shard with random weights (benchmarks): the folder needs config.json only."""
    seed: int = 0
    """Seed of the random weights (each rank draws its own shard)."""


@dataclass(frozen=True)
class LoadModel:
    """Build (or replace) the rank's model shard and runner. Replies the shard's parameter
    shapes (name -> shape)."""

    spec: RunnerSpec


@dataclass(frozen=True)
class MeasureMemory:
    """Load the rank's shard (kept for the LoadModel that follows, when its model, dtype, device
    and context length are the same) and measure what a step takes beside it. Replies a
    MemoryReport; on CPU nothing is measured (None)."""

    spec: RunnerSpec
    gpu_memory_utilization: float = 0.9


@dataclass(frozen=True)
class LoadAdapter:
    """Copy an adapter (laid out for the full model) into a slot; each rank keeps its shard, in
    the pool pages the driver lent it (None: the slot's own pages, when the rank's adapters have a
    pool of their own)."""

    slot: int
    adapter: HostAdapter
    pages: tuple[int, ...] | None = None
    ring: tuple[int, int] | None = None
    """(byte offset, bytes) of the adapter's packed pages in the rank's adapter ring
    (MapAdapterRing), where the driver wrote them; the adapter then comes without them. The rank
    answers once its copy out of the ring is done, so that the driver may write there again."""


@dataclass(frozen=True)
class MapAdapterRing:
    """Keep `ring` (host memory the driver shares, uint8) as the rank's adapter ring and pin it
    on a GPU: the driver writes packed adapters there and loads name where (LoadAdapter.ring),
    so that a load is one copy from pinned memory, in place of a fresh shared segment mapped
    and copied from pageable memory."""

    ring: torch.Tensor


@dataclass(frozen=True)
class RunStep:
    """Run one step plan to its sampled tokens. Rank 0 replies a StepOutput."""

    plan: StepPlan
    return_logits: bool = False
    """Rank 0 also returns the step's logits [num_samples, vocab] (tests, benchmarks)."""


@dataclass(frozen=True)
class TimeCollectives:
    """Time, on the loaded shard's device and dtype, the collectives of one decode step at each
    batch size: 2 x layers + 1 all-reduces of [batch, hidden] and the all-gather of the float32
    logits, each over `iterations`. Rank 0 replies a row per batch size (benchmarks)."""

    batch_sizes: tuple[int, ...]
    iterations: int = 50


@dataclass(frozen=True)
class ShareKv:
    """Let another worker process on this machine map the rank's KV cache (disaggregated
    prefill and decode: the prefill worker's, for its decode peer to copy blocks out of,
    ReceiveKv) or, with `staging_blocks`, a staging area of that many blocks made now (the
    decode worker's, for its prefill peer to push prompt blocks into, PushKv). Replies a
    KvHandle for MapPeerKv. CUDA memory is shared through IPC; on CPU, workers of a shared
    process group keep their cache, and make staging, in files under /dev/shm."""

    staging_blocks: int = 0


@dataclass(frozen=True)
class MapPeerKv:
    """Map what a peer worker shared (its ShareKv reply): its KV cache, for ReceiveKv, or
    (`staging`) its staging area, for PushKv."""

    handle: KvHandle
    staging: bool = False


@dataclass(frozen=True)
class PushKv:
    """Copy the KV of this rank's blocks `block_ids` (in that order, every layer) into the
    mapped peer staging area, from block `offset` on: gathered here, then one device-to-device
    copy (on GPUs over NVLink, on this worker's stream, after the steps queued before it, which
    wrote the blocks; the peer process not involved). Replies a KvReceived."""

    block_ids: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class ReceiveKv:
    """Copy blocks into this rank's `target_ids` (as many, in that order; every layer): from
    the mapped peer cache's blocks `source_ids` (gathered on the peer's device, one
    device-to-device copy, scattered here; the peer's blocks must hold their KV already and
    keep it until this command is answered), or, `from_staging`, from this rank's own staging
    area's blocks `source_ids` (that a PushKv filled). Replies a KvReceived."""

    source_ids: tuple[int, ...]
    target_ids: tuple[int, ...]
    from_staging: bool = False


@dataclass(frozen=True)
class Shutdown:
    """Leave the process group and exit."""


Command = (LoadModel | MeasureMemory | LoadAdapter | MapAdapterRing | RunStep | TimeCollectives | ShareKv
           | MapPeerKv | PushKv | ReceiveKv | Shutdown)

"""Device, dtype, context length, and the size of the one memory pool that the KV cache and the
adapter slots share, resolved once when the engine starts.

On CUDA the engine may use `gpu_memory_utilization` of the device's memory. The weights are
loaded first; a dummy step of the largest prefill and one of the largest decode graph are run on
scratch buffers to measure their activations (the eager peak is transient; the graphs' pool is
held for good); what is left is the pool of KV blocks and adapter slots, whose boundary moves
with demand at run time. On CPU the pool takes at most `cpu_kv_cache_bytes`."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from loraplex.engine_config import EngineConfig
from loraplex.errors import ModelLoadError
from loraplex.model.model_config import ModelConfig

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was asked for, but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def resolve_max_model_len(config: EngineConfig, model: ModelConfig) -> int:
    """The longest sequence served: the configured length, capped by the model's positions and
    by Mistral's attention window (loraplex does not mask a sliding window)."""
    limit = model.max_position_embeddings
    if model.sliding_window:
        limit = min(limit, model.sliding_window)
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ModelLoadError(f"max_model_len {config.max_model_len} exceeds this model's {limit}")
    return config.max_model_len or limit


def kv_block_bytes(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return model.num_layers * 2 * block_size * model.num_kv_heads * model.head_dim * element


@dataclass(frozen=True)
class MemoryPlan:
    num_pool_blocks: int
    """Pages of the one device pool that KV blocks and adapter slots share (a page is a KV
    block; an adapter slot takes `slot_blocks` of them)."""
    num_lora_slots: int
    """Adapter slots the pool has views for (rows of the page tables): the most adapters resident
    at once, as many as the pool holds of the smallest adapter that plan_memory was given."""
    kv_block_bytes: int
    lora_slot_bytes: int
    """Bytes a slot takes in the pool (whole pages)."""
    budget_bytes: int
    """What the pool may take."""
    activation_bytes: int = 0
    """Measured peak of the largest eager step (CUDA)."""
    graph_bytes: int = 0
    """Measured peak of the largest decode graph, with the graphs' static outputs (CUDA)."""
    max_kv_blocks: int | None = None
    """The most blocks the KV cache may hold (num_kv_blocks, when set); None: the pool's."""

    @property
    def slot_blocks(self) -> int:
        return self.lora_slot_bytes // self.kv_block_bytes

    @property
    def num_kv_blocks(self) -> int:
        """The most KV blocks a request with an adapter can have: the pool less slot 0 (kept
        for good) and one adapter's slot, or max_kv_blocks."""
        return min(self.num_pool_blocks - 2 * self.slot_blocks, self.max_kv_blocks or self.num_pool_blocks)

    def describe(self) -> str:
        mib = 2**20
        text = (f"one pool of {self.num_pool_blocks} pages of {self.kv_block_bytes / mib:.2f} MiB "
                f"({self.num_pool_blocks * self.kv_block_bytes / mib:.0f} MiB) for KV blocks and "
                f"up to {self.num_lora_slots} adapters ({self.slot_blocks} pages at the largest rank)")
        if self.activation_bytes or self.graph_bytes:
            text += (f"; set aside: activations {self.activation_bytes / mib:.0f} MiB, "
                     f"decode graphs {self.graph_bytes / mib:.0f} MiB")
        return text


def plan_memory(
    config: EngineConfig, model: ModelConfig, dtype: torch.dtype, max_model_len: int,
    lora_slot_bytes: int, budget_bytes: int, activation_bytes: int = 0, graph_bytes: int = 0,
    min_adapter_bytes: int | None = None,
) -> MemoryPlan:
    """Size the pool that KV blocks and adapter slots (`lora_slot_bytes` each, whole KV blocks)
    share: all of `budget_bytes`, but no more than the KV cache that every running request can
    use at full length beside slot 0 and max_loras adapters (max_num_seqs when max_loras is not
    set) needs. `num_kv_blocks`, when set, is a fixed KV cache (the KV cache never holds more)
    beside room for slot 0 and as many of those adapters as the rest of the budget buys (at
    least one), as benchmarks and tests that set it expect. The slots are as many as the pool
    holds (at most max_loras): of adapters of `min_adapter_bytes` when given (an adapter takes
    pages for its own rank, so smaller ones are more), else of the largest."""
    block_bytes = kv_block_bytes(model, config.cache.block_size, dtype)
    slot_blocks = -(-lora_slot_bytes // block_bytes)
    max_loras = config.lora.max_loras
    kv_blocks = config.cache.num_kv_blocks
    adapters = (1 + (max_loras or config.scheduler.max_num_seqs)) * slot_blocks
    budget_blocks = budget_bytes // block_bytes
    if kv_blocks is None:
        enough = config.scheduler.max_num_seqs * -(-max_model_len // config.cache.block_size)
        num_blocks = min(enough + adapters, budget_blocks)
    else:
        num_blocks = kv_blocks + max(2 * slot_blocks, min(adapters, budget_blocks - kv_blocks))
    if num_blocks < 2 * slot_blocks + 1:
        raise ModelLoadError(
            f"no memory is left for the KV cache ({budget_bytes / 2**20:.0f} MiB for the cache and "
            f"adapters of {slot_blocks * block_bytes / 2**20:.0f} MiB): raise gpu_memory_utilization "
            "(or cpu_kv_cache_bytes), or lower max_lora_rank or max_num_batched_tokens")
    num_slots = num_blocks // -(-(min_adapter_bytes or lora_slot_bytes) // block_bytes) - 1
    if max_loras is not None:
        num_slots = min(num_slots, max_loras)
    return MemoryPlan(num_blocks, num_slots, block_bytes, slot_blocks * block_bytes, budget_bytes,
                      activation_bytes, graph_bytes, max_kv_blocks=kv_blocks)


def cuda_budget(gpu_memory_utilization: float, device: torch.device, activation_bytes: int,
                graph_bytes: int) -> int:
    """Bytes left for the pool (KV cache and adapter slots): the engine's share of the device, less what
    is in use now (weights, other processes) and the measured activations and graphs."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    allowed = int(total * gpu_memory_utilization)
    return allowed - (total - free) - activation_bytes - graph_bytes


def make_pool(plan: MemoryPlan, device: torch.device) -> torch.Tensor:
    """The device pool: `num_pool_blocks` pages of `kv_block_bytes`, uint8, zeroed."""
    return torch.zeros(plan.num_pool_blocks * plan.kv_block_bytes, dtype=torch.uint8, device=device)


def kv_cache_view(
    pool: torch.Tensor, model: ModelConfig, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The KV cache over all of the pool: `[num_blocks, num_layers, 2, block_size, num_kv_heads,
    head_dim]` (the blocks lent to adapter slots are never handed to a sequence)."""
    block = (model.num_layers, 2, block_size, model.num_kv_heads, model.head_dim)
    return pool.view(dtype).view(-1, *block)

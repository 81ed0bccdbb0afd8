"""Device, dtype, context length, and how the engine's memory is shared between the KV cache and
the adapter slots, resolved once when the engine starts.

On CUDA the engine may use `gpu_memory_utilization` of the device's memory. The weights are
loaded first; a dummy step of the largest prefill and one of the largest decode graph are run on
scratch buffers to measure their activations (the eager peak is transient; the graphs' pool is
held for good); what is left is shared by the adapter slots and the KV cache. On CPU the two
share `cpu_kv_cache_bytes`."""

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
    num_kv_blocks: int
    num_lora_slots: int
    kv_block_bytes: int
    lora_slot_bytes: int
    budget_bytes: int
    """What the KV cache and the slots share."""
    activation_bytes: int = 0
    """Measured peak of the largest eager step (CUDA)."""
    graph_bytes: int = 0
    """Measured peak of the largest decode graph, with the graphs' static outputs (CUDA)."""

    def describe(self) -> str:
        mib = 2**20
        kv, slots = self.num_kv_blocks * self.kv_block_bytes, self.num_lora_slots * self.lora_slot_bytes
        text = (f"{self.num_kv_blocks} KV blocks ({kv / mib:.0f} MiB), "
                f"{self.num_lora_slots} adapter slots ({slots / mib:.0f} MiB)")
        if self.activation_bytes or self.graph_bytes:
            text += (f"; set aside: activations {self.activation_bytes / mib:.0f} MiB, "
                     f"decode graphs {self.graph_bytes / mib:.0f} MiB")
        return text


def plan_memory(
    config: EngineConfig, model: ModelConfig, dtype: torch.dtype, max_model_len: int,
    lora_slot_bytes: int, budget_bytes: int, activation_bytes: int = 0, graph_bytes: int = 0,
) -> MemoryPlan:
    """Split `budget_bytes` between adapter slots and KV blocks. Slots: `max_loras`, or what
    `lora_memory_fraction` of the budget buys (at most max_num_seqs, at least one); KV blocks:
    `num_kv_blocks`, or the rest, never more than every running request at full length can use."""
    block_bytes = kv_block_bytes(model, config.cache.block_size, dtype)
    max_num_seqs = config.scheduler.max_num_seqs
    slots = config.lora.max_loras
    if slots is None:
        affordable = int(budget_bytes * config.lora.lora_memory_fraction) // lora_slot_bytes
        slots = max(1, min(max_num_seqs, affordable))
    num_blocks = config.cache.num_kv_blocks
    if num_blocks is None:
        enough = max_num_seqs * -(-max_model_len // config.cache.block_size)
        num_blocks = min(enough, (budget_bytes - slots * lora_slot_bytes) // block_bytes)
    if num_blocks < 1:
        raise ModelLoadError(
            f"no memory is left for the KV cache ({budget_bytes / 2**20:.0f} MiB for the cache and "
            f"{slots} adapter slots of {lora_slot_bytes / 2**20:.0f} MiB): raise gpu_memory_utilization "
            "(or cpu_kv_cache_bytes), or lower max_loras, max_lora_rank or max_num_batched_tokens")
    return MemoryPlan(num_blocks, slots, block_bytes, lora_slot_bytes, budget_bytes, activation_bytes,
                      graph_bytes)


def cuda_budget(config: EngineConfig, device: torch.device, activation_bytes: int, graph_bytes: int) -> int:
    """Bytes left for the KV cache and the slots: the engine's share of the device, less what
    is in use now (weights, other processes) and the measured activations and graphs."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    allowed = int(total * config.cache.gpu_memory_utilization)
    return allowed - (total - free) - activation_bytes - graph_bytes


def make_kv_cache(plan: MemoryPlan, model: ModelConfig, block_size: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """The KV cache `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, zeroed."""
    shape = (plan.num_kv_blocks, model.num_layers, 2, block_size, model.num_kv_heads, model.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)

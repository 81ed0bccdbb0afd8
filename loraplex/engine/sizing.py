"""Device, dtype, context length and KV cache size, resolved once when the engine starts."""

from __future__ import annotations

import logging

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


def make_kv_cache(
    config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device,
    max_model_len: int,
) -> torch.Tensor:
    """The KV cache `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, zeroed."""
    cache, bs = config.cache, config.cache.block_size
    block_bytes = kv_block_bytes(model, bs, dtype)
    # Never more than every running request at full length can use.
    enough = config.scheduler.max_num_seqs * -(-max_model_len // bs)
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        num_blocks = min(enough, int(free * cache.memory_fraction) // block_bytes)
    else:
        num_blocks = min(enough, cache.cpu_cache_bytes // block_bytes)
    if num_blocks < 1:
        raise ModelLoadError("no memory is left for the KV cache")
    logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, bs,
                num_blocks * block_bytes / 2**20)
    shape = (num_blocks, model.num_layers, 2, bs, model.num_kv_heads, model.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)

"""Engine configuration: frozen dataclasses, built once at the edge (CLI, server, `LLM`) and
passed down. Values learned at run time (the number of KV blocks, the eos id) live in other
objects; nothing here is ever written back."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int | None = None
    """KV blocks to allocate; None sizes the cache from memory (`memory_fraction` of free GPU
    memory on CUDA, `cpu_cache_bytes` on CPU)."""
    memory_fraction: float = 0.85
    """Fraction of free GPU memory (after weights and LoRA slots) given to the KV cache."""
    cpu_cache_bytes: int = 1 << 30
    """KV cache size on CPU when `num_blocks` is not set."""

    def __post_init__(self) -> None:
        _check(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
               "block_size must be a power of two")
        _check(self.num_blocks is None or self.num_blocks > 0, "num_blocks must be positive")
        _check(0.0 < self.memory_fraction <= 1.0, "memory_fraction must be in (0, 1]")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: decodes first, then prompt chunks up to this many tokens."""

    def __post_init__(self) -> None:
        _check(self.max_num_seqs > 0, "max_num_seqs must be positive")
        _check(self.max_num_batched_tokens > 0, "max_num_batched_tokens must be positive")


@dataclass(frozen=True)
class LoRAConfig:
    max_lora_rank: int = 64
    """Largest adapter rank accepted; slot buffers are this wide, kernels skip the padding."""
    max_loras: int = 8
    """Adapters resident on the device at once (slots, not counting slot 0 = no adapter); also
    the most distinct adapters in one step."""

    def __post_init__(self) -> None:
        _check(self.max_lora_rank > 0, "max_lora_rank must be positive")
        _check(self.max_loras > 0, "max_loras must be positive")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    """Path to a local Hugging Face model folder."""
    device: str = "auto"
    """"auto" (cuda when present), "cpu" or "cuda"."""
    dtype: str = "auto"
    """"auto" (bfloat16 on CUDA, float32 on CPU), "float32", "float16" or "bfloat16"."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output); None takes the model's max_position_embeddings."""
    seed: int = 0
    """Seed for requests that set none of their own."""
    use_cuda_graphs: bool = True
    """Capture decode steps as CUDA graphs (CUDA only)."""
    async_scheduling: bool | None = None
    """Plan and launch each step while the device still runs the previous one, so the host's
    work hides behind the device's (None: on CUDA only, where it pays). Outputs then come one
    step later, and a request that stops on a token computes one token more (discarded)."""
    kernels: str = "auto"
    """"auto" (Triton on CUDA, the torch reference on CPU), "triton" or "reference"."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        _check(self.device in ("auto", "cpu", "cuda"),
               f"device must be auto, cpu or cuda, not {self.device!r}")
        _check(self.dtype in ("auto", "float32", "float16", "bfloat16"),
               f"dtype must be auto, float32, float16 or bfloat16, not {self.dtype!r}")
        _check(self.max_model_len is None or self.max_model_len > 0, "max_model_len must be positive")
        _check(self.kernels in ("auto", "triton", "reference"),
               f"kernels must be auto, triton or reference, not {self.kernels!r}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (`block_size=32, max_loras=4, ...`), routing each to
        the sub-config that owns it. Unknown names raise TypeError."""
        subs = {"cache": CacheConfig, "scheduler": SchedulerConfig, "lora": LoRAConfig}
        top = {f.name for f in fields(cls)} - set(subs)
        top_kwargs: dict[str, Any] = {}
        sub_kwargs: dict[str, dict[str, Any]] = {name: {} for name in subs}
        for key, value in kwargs.items():
            if key in top or key in subs:
                top_kwargs[key] = value
                continue
            owner = next((name for name, c in subs.items() if key in {f.name for f in fields(c)}), None)
            if owner is None:
                raise TypeError(f"unknown engine option {key!r}")
            sub_kwargs[owner][key] = value
        config = cls(model=model, **top_kwargs)
        return replace(config, **{
            name: replace(getattr(config, name), **values)
            for name, values in sub_kwargs.items() if values
        })


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)

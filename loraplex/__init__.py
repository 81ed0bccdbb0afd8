"""loraplex: serve many LoRA adapters to many tenants from one GPU engine.

The offline API: `from loraplex import LLM, SamplingParams`. `LLM` is imported lazily so that
torch-free layers (the registry, the CLI's database commands) do not pay for torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loraplex.types import RequestOutput, SamplingParams, StreamingWindow

if TYPE_CHECKING:
    from loraplex.engine.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StreamingWindow"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from loraplex.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'loraplex' has no attribute {name!r}")

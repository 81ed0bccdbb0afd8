"""The shape of the demo model: a tiny Llama with grouped-query attention (4 query heads over 2
KV heads), so that the engine's GQA path runs in the demo and in CI."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaConfig


@dataclass(frozen=True)
class DemoModelSpec:
    hidden_size: int = 128
    """Model width; head_dim is hidden_size / num_heads = 32."""
    intermediate_size: int = 384
    """Width of the SwiGLU MLP (3 x hidden, about Llama's ratio)."""
    num_layers: int = 2
    """Decoder blocks."""
    num_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 2
    """Key/value heads, fewer than num_heads: grouped-query attention."""
    max_position_embeddings: int = 2048
    """Longest sequence the server will accept for the demo."""
    rope_theta: float = 10000.0
    """Rotary embedding base (plain rope, no scaling)."""
    rms_norm_eps: float = 1e-5
    """Epsilon of the RMS norms."""
    tie_word_embeddings: bool = False
    """The LM head has its own weights, as in Llama 2/3-8B."""


DEMO_MODEL = DemoModelSpec()


def make_llama_config(
    spec: DemoModelSpec, vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int
) -> LlamaConfig:
    """The Hugging Face config of the demo model; the token ids come from its tokenizer."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        # Not saved to config.json: eager attention trains a model this small on CPU faster
        # than sdpa does.
        attn_implementation="eager",
    )

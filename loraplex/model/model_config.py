"""The base model's architecture, read from a Hugging Face config.json. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.adapter_format import BaseModelShape
from loraplex.errors import ModelLoadError
from loraplex.json_limits import loads_bounded

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
MAX_CONFIG_DEPTH = 32
"""Nesting a model's config.json may have (real ones have 3 or 4 levels)."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    """"llama", "mistral" or "qwen2"."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    """Rope parameters beyond theta ("linear" or "llama3"), None for plain rope."""
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    """Mistral's attention window; loraplex caps the context at it instead of masking."""
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None
    name: str | None = None
    """The model's own name (config.json `_name_or_path`: a hub id as it is, a path's last
    part), None when the config has none."""

    @property
    def shape(self) -> BaseModelShape:
        return BaseModelShape(
            num_layers=self.num_layers, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def load(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder} has no config.json; is it a Hugging Face model folder?")
        try:
            data = loads_bounded(path.read_bytes(), MAX_CONFIG_DEPTH)
        except ValueError as exc:
            raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        architecture = _architecture(data)
        if data.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"hidden_act {data['hidden_act']!r} is not supported; only silu")
        if data.get("mlp_bias"):
            raise ModelLoadError("mlp_bias is not supported")
        theta, scaling = _rope(data)
        hidden, heads = data["hidden_size"], data["num_attention_heads"]
        attention_bias = bool(data.get("attention_bias", False))
        sliding_window = data.get("sliding_window")
        if architecture == "qwen2" and not data.get("use_sliding_window", False):
            sliding_window = None
        eos = data.get("eos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=data["vocab_size"],
            hidden_size=hidden,
            intermediate_size=data["intermediate_size"],
            num_layers=data["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=data.get("num_key_value_heads") or heads,
            head_dim=data.get("head_dim") or hidden // heads,
            rms_norm_eps=data.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=data.get("max_position_embeddings", 2048),
            qkv_bias=architecture == "qwen2" or attention_bias,
            o_bias=architecture != "qwen2" and attention_bias,
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            sliding_window=sliding_window,
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            bos_token_id=data.get("bos_token_id"),
            torch_dtype=data.get("torch_dtype") or data.get("dtype"),
            name=_name(data.get("_name_or_path")),
        )


def _architecture(data: dict[str, Any]) -> str:
    names = data.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    model_type = data.get("model_type")
    if not names and model_type in SUPPORTED_ARCHITECTURES.values():
        return model_type
    found = ", ".join(names) or repr(model_type)
    raise ModelLoadError(
        f"unsupported architecture {found}; loraplex serves {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _name(name_or_path: Any) -> str | None:
    """A hub id (`org/model`) as it is; a local path (absolute, relative or deeper) by its last
    part."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        return None
    name = name_or_path.strip()
    if name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1:
        return name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1] or None
    return name


def _rope(data: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either transformers 5's rope_parameters or the older
    rope_theta + rope_scaling."""
    params = dict(data.get("rope_parameters") or data.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", data.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    return theta, params

"""A Hugging Face config.json from a GGUF file's metadata, for the architectures loraplex serves
(GGUF `llama`, which also holds Mistral's converted models, and `qwen2`)."""

from __future__ import annotations

import re
from typing import Any

from loraplex.errors import ModelLoadError
from loraplex.model.gguf_file import GGUFFile

HF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}
"""GGUF general.architecture -> (Hugging Face architecture, model_type)."""


def gguf_config(model: GGUFFile, name: str | None = None) -> dict[str, Any]:
    """config.json's contents. `name` (default: the GGUF's general.name) becomes
    `_name_or_path`, the id loraplex serves the model under."""
    arch = model.require("general.architecture")
    if arch not in HF_ARCHITECTURES:
        raise ModelLoadError(f"{model.path.name}: unsupported architecture {arch!r}; the GGUF import "
                             f"supports {', '.join(HF_ARCHITECTURES)}")
    architecture, model_type = HF_ARCHITECTURES[arch]
    hidden = model.require(f"{arch}.embedding_length")
    num_heads = model.require(f"{arch}.attention.head_count")
    head_dim = model.get(f"{arch}.attention.key_length", hidden // num_heads)
    rotary_dim = model.get(f"{arch}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ModelLoadError(f"{model.path.name}: partial rotary embeddings ({rotary_dim} of {head_dim} "
                             "dimensions) are not supported")
    tokens = model.require("tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "_name_or_path": name or model_name(model),
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": model.get(f"{arch}.vocab_size", len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": model.require(f"{arch}.feed_forward_length"),
        "num_hidden_layers": model.require(f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": model.get(f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(model.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(model.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": model.get(f"{arch}.context_length", 2048),
        "tie_word_embeddings": not any(tensor.name == "output.weight" for tensor in model.tensors),
        "bos_token_id": model.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": model.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "bfloat16",
    }
    if model.get("tokenizer.ggml.padding_token_id") is not None:
        config["pad_token_id"] = model.get("tokenizer.ggml.padding_token_id")
    scaling = _rope_scaling(model, arch)
    if scaling is not None:
        config["rope_scaling"] = scaling
    if arch == "llama":
        config["attention_bias"] = any(t.name.endswith("attn_q.bias") for t in model.tensors)
    return config


def model_name(model: GGUFFile) -> str:
    """The model's own name from the metadata (general.name, spaces made dashes), else the
    file name without its quantization suffix."""
    name = model.get("general.name")
    if isinstance(name, str) and name.strip():
        return "-".join(name.split())
    return re.sub(r"[.-](I?Q\d\w*|F16|F32|BF16)$", "", model.path.stem, flags=re.IGNORECASE)


def _rope_scaling(model: GGUFFile, arch: str) -> dict[str, Any] | None:
    kind = model.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        if any(tensor.name == "rope_freqs.weight" for tensor in model.tensors):
            raise ModelLoadError(f"{model.path.name}: rope frequency factors (rope_freqs, Llama 3.1's rope "
                                 "scaling) are not supported by the GGUF import")
        return None
    if kind != "linear":
        raise ModelLoadError(f"{model.path.name}: rope scaling {kind!r} is not supported; only linear")
    return {"rope_type": "linear", "factor": float(model.require(f"{arch}.rope.scaling.factor"))}

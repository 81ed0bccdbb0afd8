"""Load a Llama-family model from a local Hugging Face folder: config.json and one or sharded
safetensors files. q/k/v and gate/up are fused here. Pickle checkpoints are refused, never
opened."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from loraplex.errors import ModelLoadError
from loraplex.kernels import Ops
from loraplex.model.llama import LlamaForCausalLM
from loraplex.model.model_config import ModelConfig

PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder, single or sharded."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise ModelLoadError(f"{index} is not a valid safetensors index") from None
        names = sorted(set(weight_map.values()))
        for name in names:
            if Path(name).name != name or name in (".", ".."):
                raise ModelLoadError(f"{index.name} names a shard outside the folder: {name}")
        files = [folder / name for name in names]
        for path in files:
            if not path.is_file():
                raise ModelLoadError(f"shard {path.name} listed in {index.name} is missing")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    pickles = [p.name for pattern in PICKLE_PATTERNS for p in folder.glob(pattern)]
    if pickles:
        raise ModelLoadError(
            f"{folder} holds only pickle checkpoints ({', '.join(sorted(pickles))}); loraplex loads "
            f"safetensors only and never unpickles files. Convert with "
            f"model.save_pretrained(dir, safe_serialization=True)."
        )
    raise ModelLoadError(f"{folder} has no model.safetensors or model.safetensors.index.json")


def _hf_names(config: ModelConfig) -> dict[str, list[str]]:
    """Our parameter name -> the Hugging Face tensors it is made of, concatenated on dim 0."""
    names = {"embed_tokens": ["model.embed_tokens.weight"], "norm": ["model.norm.weight"]}
    if not config.tie_word_embeddings:
        names["lm_head"] = ["lm_head.weight"]
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        names[f"{ours}.input_norm"] = [f"{hf}.input_layernorm.weight"]
        names[f"{ours}.post_attention_norm"] = [f"{hf}.post_attention_layernorm.weight"]
        names[f"{ours}.attn.qkv_weight"] = [f"{hf}.self_attn.{m}_proj.weight" for m in "qkv"]
        if config.qkv_bias:
            names[f"{ours}.attn.qkv_bias"] = [f"{hf}.self_attn.{m}_proj.bias" for m in "qkv"]
        names[f"{ours}.attn.o_weight"] = [f"{hf}.self_attn.o_proj.weight"]
        if config.o_bias:
            names[f"{ours}.attn.o_bias"] = [f"{hf}.self_attn.o_proj.bias"]
        names[f"{ours}.mlp.gate_up_weight"] = [f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"]
        names[f"{ours}.mlp.down_weight"] = [f"{hf}.mlp.down_proj.weight"]
    return names


def load_model(
    folder: str | Path, config: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device,
    max_positions: int,
) -> LlamaForCausalLM:
    """Build the model and fill every parameter from the folder's safetensors files."""
    folder = Path(folder)
    files = weight_files(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, ops, max_positions)
    model.to_empty(device=device)
    handles = [safe_open(str(path), framework="pt", device="cpu") for path in files]
    located = {name: handle for handle in handles for name in handle.keys()}  # noqa: SIM118 (safe_open is no dict)
    params = dict(model.named_parameters(remove_duplicate=False))
    for ours, hf_names in _hf_names(config).items():
        missing = [name for name in hf_names if name not in located]
        if missing:
            raise ModelLoadError(f"{folder}: tensor {missing[0]} is missing from the checkpoint")
        parts = [located[name].get_tensor(name) for name in hf_names]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        target = params[ours]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"{folder}: {', '.join(hf_names)} has shape {list(tensor.shape)}, but config.json "
                f"implies {list(target.shape)}"
            )
        with torch.no_grad():
            target.data = tensor.to(device=device, dtype=dtype)
    model.reset_rope()  # to_empty left the rope table uninitialised
    return model.eval()

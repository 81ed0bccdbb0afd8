"""A GGUF file's tensors as Hugging Face tensors: GGUF names mapped to Hugging Face names,
quantized blocks dequantized (gguf.quants), and the rows of Llama's q/k projections put back in
Hugging Face's order.

llama.cpp's Llama converter reorders each head's rows of q_proj and k_proj so that its rotary
embedding, which rotates adjacent pairs (x0, x1), (x2, x3), ..., computes what Hugging Face's
rotate-half does on pairs (x0, x_{d/2}), (x1, x_{d/2+1}), ...: within a head of d rows, GGUF row
2i is Hugging Face row i and GGUF row 2i+1 is row d/2 + i. Qwen2 files use the rotate-half
order already and are left as they are."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from loraplex.errors import ModelLoadError
from loraplex.model.gguf_file import GGUFFile

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
"""GGML tensor types the import dequantizes."""

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor (`blk.3.attn_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`)."""
    block = _BLOCK_PATTERN.fullmatch(gguf_name)
    if block is not None and block.group(2) in _BLOCK_NAMES:
        layer, part, kind = block.groups()
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    raise ModelLoadError(f"unsupported tensor {gguf_name!r} in the GGUF file")


def check_tensor_types(model: GGUFFile) -> None:
    """Refuse, by name, a file with tensors of a type the import does not dequantize."""
    unsupported = sorted({t.tensor_type.name for t in model.tensors} - set(SUPPORTED_TYPES))
    if unsupported:
        raise ModelLoadError(f"{model.path.name}: unsupported tensor type(s) {', '.join(unsupported)}; the "
                             f"GGUF import supports {', '.join(SUPPORTED_TYPES)}")
    for tensor in model.tensors:
        hf_name(tensor.name)  # an unknown tensor is refused before anything is written


def hf_tensors(model: GGUFFile, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor in `dtype`) for every tensor of the file, in file order."""
    config_arch = model.require("general.architecture")
    num_heads = model.require(f"{config_arch}.attention.head_count")
    num_kv_heads = model.get(f"{config_arch}.attention.head_count_kv", num_heads)
    for tensor in model.tensors:
        name = hf_name(tensor.name)
        values = torch.from_numpy(dequantize(tensor))
        if config_arch == "llama" and ".self_attn.q_proj." in name:
            values = unpermute_rows(values, num_heads)
        elif config_arch == "llama" and ".self_attn.k_proj." in name:
            values = unpermute_rows(values, num_kv_heads)
        yield name, values.to(dtype)


def dequantize(tensor: Any) -> np.ndarray:
    """float32 values in Hugging Face's shape (GGML's shape reversed: [rows, columns])."""
    from gguf.quants import dequantize as gguf_dequantize

    values = gguf_dequantize(np.asarray(tensor.data), tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    if values.size != int(np.prod(shape)):
        raise ModelLoadError(f"tensor {tensor.name}: {values.size} values, but its shape is {list(shape)}")
    # a float32 tensor comes back as a read-only view of the memory-mapped file: copy it
    return values.reshape(shape).astype(np.float32, copy=not values.flags.writeable)


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order. weight: [num_heads * head_dim, ...] (or a bias)."""
    head_dim = weight.shape[0] // num_heads
    # GGUF rows of one head: [head_dim / 2 pairs, 2]; Hugging Face's: [2 halves, head_dim / 2]
    grouped = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape).contiguous()


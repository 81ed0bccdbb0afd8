"""GGUF files written on the spot for the import tests: a tiny random transformers model stored
as llama.cpp stores it (GGUF tensor names, GGML shapes, Llama's q/k rows reordered for its
rotary embedding, 2-D weights quantized to a chosen type), with a small byte-level BPE
vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.factories import hf_config

GGUF_TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=512, bos_token_id=1,
                 eos_token_id=2)
"""Widths that are multiples of 256, the block of the K-quant types."""
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = (("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"))
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_HF_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}


def vocabulary() -> list[str]:
    from tokenizers import pre_tokenizers

    return [*SPECIALS, *sorted(pre_tokenizers.ByteLevel.alphabet()), *("".join(m) for m in MERGES)]


def make_tiny_model(arch: str, seed: int = 0):
    """A random tiny transformers model (float32, eval) whose vocabulary is vocabulary()."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    overrides = {**GGUF_TINY, "vocab_size": len(vocabulary())}
    if arch == "llama":
        overrides["rope_scaling"] = None
    model = AutoModelForCausalLM.from_config(hf_config(arch, **overrides)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(1.0 if "norm" in name else 0.0, 0.5)
    return model


def permute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order from Hugging Face's: within each head of d rows, Hugging Face
    row i goes to 2i and row d/2 + i to 2i + 1."""
    head_dim = weight.shape[0] // num_heads
    grouped = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape).contiguous()


def gguf_name(hf: str) -> str:
    stem, _, kind = hf.rpartition(".")
    if stem in _HF_TO_GGUF:
        return f"{_HF_TO_GGUF[stem]}.{kind}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_BLOCK[rest]}.{kind}"


def random_blocks(qtype, rows: int, columns: int, seed: int) -> np.ndarray:
    """Random raw blocks of a K-quant type (gguf cannot quantize to them), with finite scales."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, columns // block, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, (rows, columns // block, 2)).astype(np.float16).view(np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d and dmin lead the block
        raw[..., 0:4] = scales.reshape(rows, columns // block, 4)
    else:  # Q6_K: d ends the block
        raw[..., size - 2:] = scales[..., 0:2]
    return raw.reshape(rows, -1)


def write_gguf(model, path: Path, qtype_name: str = "F32", *, arch: str | None = None,
               name: str = "Tiny Test Model", pre: str = "smollm") -> dict[str, torch.Tensor]:
    """Write `model` as a GGUF file with its 2-D weights as `qtype_name`. Returns the tensors
    a faithful import must produce (Hugging Face names and order, float32, before bf16)."""
    import gguf
    from gguf.quants import dequantize, quantize

    qtype = gguf.GGMLQuantizationType[qtype_name]
    config = model.config
    arch = arch or config.model_type
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    tokens = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) for m in MERGES])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    expected = {}
    for index, (hf, tensor) in enumerate(model.state_dict().items()):
        if hf == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = tensor.detach().float()
        if arch == "llama" and ".q_proj." in hf:
            values = permute_rows(values, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf:
            values = permute_rows(values, config.num_key_value_heads)
        array = values.numpy()
        if array.ndim == 1 or qtype_name == "F32":
            writer.add_tensor(gguf_name(hf), array)
            stored = array
        elif qtype_name == "F16":
            writer.add_tensor(gguf_name(hf), array.astype(np.float16))
            stored = array.astype(np.float16).astype(np.float32)
        else:
            raw = (random_blocks(qtype, *array.shape, seed=index) if qtype_name in ("Q4_K", "Q6_K")
                   else quantize(array, qtype))
            writer.add_tensor(gguf_name(hf), raw, raw_shape=raw.shape, raw_dtype=qtype)
            stored = dequantize(raw, qtype)
        # What the stored GGUF values are in Hugging Face's row order.
        result = torch.from_numpy(np.array(stored, dtype=np.float32)).reshape(tensor.shape)
        if arch == "llama" and ".q_proj." in hf:
            result = _unpermute(result, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf:
            result = _unpermute(result, config.num_key_value_heads)
        expected[hf] = result
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of permute_rows, found by permuting row indices (independent of the import's
    own code)."""
    order = permute_rows(torch.arange(weight.shape[0]).float(), num_heads).long()
    result = torch.empty_like(weight)
    result[order] = weight
    return result

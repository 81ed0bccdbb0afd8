"""Models and adapters with random weights, built straight on the device (nothing can be
downloaded), and the same weights seen as a Hugging Face model with PEFT adapters, so both
engines run on identical numbers."""

from __future__ import annotations

import math
from typing import Any

import torch

from loraplex.engine.lora_weights import HostAdapter, group_dims
from loraplex.kernels import Ops
from loraplex.model.llama import LORA_GROUPS, LlamaForCausalLM
from loraplex.model.model_config import ModelConfig

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)


def model_config(overrides: dict[str, Any] | None = None) -> ModelConfig:
    """Llama-3-8B's shape (or another, through overrides of config.json keys)."""
    return ModelConfig.from_dict({**LLAMA3_8B, **(overrides or {})})


@torch.no_grad()
def random_model(
    config: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device, max_positions: int,
    seed: int = 0, scaled_residual: bool = False,
) -> LlamaForCausalLM:
    """Weights N(0, 0.02) (the Llama initialisation), norms 1: logits spread like a real
    model's, never zeros. With `scaled_residual`, the projections that write into the residual
    stream (o, down) get N(0, 0.02 / sqrt(2 * num_layers)), as GPT-2 initialises them: random
    layers then add small updates instead of compounding noise through depth."""
    residual_std = 0.02 / math.sqrt(2 * config.num_layers) if scaled_residual else 0.02
    with torch.device("meta"):
        model = LlamaForCausalLM(config, ops, max_positions)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        param.data = param.data.to(dtype)
        if name.endswith("norm"):
            param.fill_(1.0)
        elif name.endswith(("o_weight", "down_weight")):
            param.normal_(0.0, residual_std, generator=generator)
        else:
            param.normal_(0.0, 0.02, generator=generator)
    model.reset_rope()
    return model.eval()


@torch.no_grad()
def random_adapter(
    config: ModelConfig, rank: int, dtype: torch.dtype, device: torch.device, name: str, seed: int,
    pin: bool,
) -> HostAdapter:
    """A rank-`rank` adapter on all seven projections of every layer, laid out for slot
    copies. A ~ N(0, 1/in), B ~ N(0, 0.02/sqrt(rank)): the delta is a few percent of the base
    projection's output, as a trained adapter's is."""
    generator = torch.Generator(device=device).manual_seed(seed)
    a, b, ranks = {}, {}, {}
    for group, modules in LORA_GROUPS.items():
        in_features, offsets = group_dims(config, group)
        shape_a = (config.num_layers, len(modules), rank, in_features)
        shape_b = (config.num_layers, offsets[-1], rank)
        a_g = torch.randn(shape_a, generator=generator, device=device).mul_(in_features ** -0.5)
        b_g = torch.randn(shape_b, generator=generator, device=device).mul_(0.02 / math.sqrt(rank))
        a[group], b[group] = a_g.to(dtype).cpu(), b_g.to(dtype).cpu()
        if pin:
            a[group], b[group] = a[group].pin_memory(), b[group].pin_memory()
        ranks[group] = torch.full((config.num_layers, len(modules)), rank, dtype=torch.int32)
        if pin:
            ranks[group] = ranks[group].pin_memory()
    return HostAdapter(digest=f"synthetic-{name}", rank=rank, a=a, b=b, ranks=ranks)


@torch.no_grad()
def hf_model_sharing_weights(model: LlamaForCausalLM) -> Any:
    """A transformers LlamaForCausalLM whose parameters are views of `model`'s (no copy): q, k
    and v (and gate, up) are row slices of the fused weights."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    c = model.config
    hf_config = LlamaConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        vocab_size=c.vocab_size, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
        tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.qkv_bias,
    )
    with torch.device("meta"):
        hf = HFLlama(hf_config)
    device, dtype = model.embed_tokens.device, model.embed_tokens.dtype  # every weight is a view

    def put(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
        setattr(module, name, torch.nn.Parameter(tensor, requires_grad=False))

    put(hf.model.embed_tokens, "weight", model.embed_tokens)
    put(hf.model.norm, "weight", model.norm)
    put(hf.lm_head, "weight", model.embed_tokens if c.tie_word_embeddings else model.lm_head)
    q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
    for ours, theirs in zip(model.layers, hf.model.layers):
        put(theirs.input_layernorm, "weight", ours.input_norm)
        put(theirs.post_attention_layernorm, "weight", ours.post_attention_norm)
        qkv = ours.attn.qkv_weight
        put(theirs.self_attn.q_proj, "weight", qkv[:q])
        put(theirs.self_attn.k_proj, "weight", qkv[q:q + kv])
        put(theirs.self_attn.v_proj, "weight", qkv[q + kv:])
        put(theirs.self_attn.o_proj, "weight", ours.attn.o_weight)
        put(theirs.mlp.gate_proj, "weight", ours.mlp.gate_up_weight[:inter])
        put(theirs.mlp.up_proj, "weight", ours.mlp.gate_up_weight[inter:])
        put(theirs.mlp.down_proj, "weight", ours.mlp.down_weight)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf_config).to(device)  # float32 tables
    hf.config.dtype = dtype
    return hf.eval()


@torch.no_grad()
def add_peft_adapters(hf_model: Any, adapters: dict[str, HostAdapter], config: ModelConfig) -> Any:
    """Wrap `hf_model` with PEFT adapters holding the same weights as `adapters`."""
    from peft import LoraConfig, PeftModel, get_peft_model

    targets = [m for modules in LORA_GROUPS.values() for m in modules]
    peft_model: PeftModel | None = None
    for name, host in adapters.items():
        lora = LoraConfig(r=host.rank, lora_alpha=host.rank, target_modules=targets, lora_dropout=0.0)
        if peft_model is None:
            peft_model = get_peft_model(hf_model, lora, adapter_name=name)
        else:
            peft_model.add_adapter(name, lora)
        _copy_into_peft(peft_model, name, host, config)
    return peft_model.eval()


def _copy_into_peft(peft_model: Any, name: str, host: HostAdapter, config: ModelConfig) -> None:
    layers = peft_model.base_model.model.model.layers
    r = host.rank
    for group, modules in LORA_GROUPS.items():
        _, offsets = group_dims(config, group)
        for i, layer in enumerate(layers):
            for s, module in enumerate(modules):
                parent = layer.self_attn if module in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp
                target = getattr(parent, module)
                device = target.lora_A[name].weight.device
                target.lora_A[name].weight.copy_(host.a[group][i, s, :r].to(device))
                target.lora_B[name].weight.copy_(host.b[group][i, offsets[s]:offsets[s + 1], :r].to(device))

"""The Llama family (Llama 2/3, Mistral, Qwen2) as one module tree. q/k/v and gate/up are
fused; every op outside the dense GEMMs goes through the op set (`loraplex.kernels`), and each
projection adds its per-token LoRA delta when the batch carries adapters."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels import Ops
from loraplex.model.context import get_forward_context
from loraplex.model.model_config import ModelConfig
from loraplex.model.rope import cos_sin_cache

# Module groups that carry LoRA slot buffers, and the adapter modules each stacks.
LORA_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def apply_lora(layer: int, group: str, ops: Ops, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y [num_tokens, out] += the LoRA delta of each token's adapter for x [num_tokens, in]."""
    lora = get_forward_context().lora
    if lora is None:
        return y
    weights = lora.buffers.group(layer, group)
    shrunk = ops.lora_shrink(x, weights.a, lora.token_slots, weights.ranks)
    return ops.lora_expand(y, shrunk, weights.b, lora.token_slots, weights.ranks, weights.slice_offsets)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, ops: Ops) -> None:
        super().__init__()
        self.layer, self.ops = layer, ops
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads, config.num_kv_heads, config.head_dim)
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim ** -0.5
        self.qkv_weight = _empty(config.q_size + 2 * config.kv_size, config.hidden_size)
        self.qkv_bias = _empty(config.q_size + 2 * config.kv_size) if config.qkv_bias else None
        self.o_weight = _empty(config.hidden_size, config.q_size)
        self.o_bias = _empty(config.hidden_size) if config.o_bias else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        context = get_forward_context()
        meta = context.attention
        num_tokens = x.shape[0]
        qkv = self.ops.linear(x, self.qkv_weight, self.qkv_bias)  # [num_tokens, q + 2 kv]
        qkv = apply_lora(self.layer, "qkv", self.ops, x, qkv)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        kv_layer = context.kv_cache[:, self.layer]  # [num_blocks, 2, block_size, kv_heads, head_dim]
        q = self.ops.rotary_store_kv(positions, q, k, v, cos_sin, kv_layer, meta.slot_mapping)
        if meta.is_decode:
            out = self.ops.paged_decode_attention(q, kv_layer, meta.block_tables, meta.seq_lens, self.scale)
        else:
            out = self.ops.paged_attention(
                q, kv_layer, meta.block_tables, meta.query_start_loc, meta.seq_lens, self.scale,
                max_query_len=meta.max_query_len,
            )
        out = out.reshape(num_tokens, self.q_size)
        o = self.ops.linear(out, self.o_weight, self.o_bias)
        return apply_lora(self.layer, "o", self.ops, out, o)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, ops: Ops) -> None:
        super().__init__()
        self.layer, self.ops = layer, ops
        self.gate_up_weight = _empty(2 * config.intermediate_size, config.hidden_size)
        self.down_weight = _empty(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.ops.linear(x, self.gate_up_weight)  # [num_tokens, 2 * intermediate]
        gate_up = apply_lora(self.layer, "gate_up", self.ops, x, gate_up)
        hidden = self.ops.silu_and_mul(gate_up)
        down = self.ops.linear(hidden, self.down_weight)
        return apply_lora(self.layer, "down", self.ops, hidden, down)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, ops: Ops) -> None:
        super().__init__()
        self.ops, self.eps = ops, config.rms_norm_eps
        self.input_norm = _empty(config.hidden_size)
        self.post_attention_norm = _empty(config.hidden_size)
        self.attn = Attention(config, layer, ops)
        self.mlp = MLP(config, layer, ops)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            # A 16-bit model keeps its residual stream in float32: on a random Llama-3-8B-shaped
            # model that cut bf16's logits error by 14% (bench/results/precision-study-cpu.md)
            # for 0.4% more traffic a step.
            residual, x = x.float(), self.ops.rms_norm(x, self.input_norm, self.eps)
        else:
            x, residual = self.ops.fused_add_rms_norm(x, residual, self.input_norm, self.eps)
        x = self.attn(positions, x, cos_sin)
        x, residual = self.ops.fused_add_rms_norm(x, residual, self.post_attention_norm, self.eps)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """Takes flat token ids and positions of a batch (the layout is in the forward context) and
    returns hidden states; `compute_logits` maps the rows that sample to float32 logits."""

    def __init__(self, config: ModelConfig, ops: Ops, max_positions: int) -> None:
        super().__init__()
        self.config, self.ops = config, ops
        self.embed_tokens = _empty(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, ops) for i in range(config.num_layers))
        self.norm = _empty(config.hidden_size)
        if not config.tie_word_embeddings:
            self.lm_head = _empty(config.vocab_size, config.hidden_size)
        self.max_positions = max_positions
        self.register_buffer("cos_sin", torch.empty(max_positions, config.head_dim), persistent=False)
        self.reset_rope()

    def reset_rope(self) -> None:
        """Fill the rope table [max_positions, head_dim] (float32, on the model's device)."""
        c = self.config
        if self.cos_sin.device.type != "meta":
            table = cos_sin_cache(c.head_dim, self.max_positions, c.rope_theta, c.rope_scaling)
            self.cos_sin = table.to(self.cos_sin.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> hidden [num_tokens, hidden_size]."""
        x = F.embedding(input_ids, self.embed_tokens)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, self.cos_sin)
        x, _ = self.ops.fused_add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_rows, hidden_size] -> logits [num_rows, vocab_size] float32. The decode
        kernel (skinny GEMM, up to 64 rows on CUDA) writes its float32 sums unrounded: bf16
        logits near 6 are 0.03 apart, enough to tie or swap the top tokens. Past it, cuBLAS's
        16-bit logits are widened."""
        head = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        return self.ops.linear(hidden, head, out_dtype=torch.float32)

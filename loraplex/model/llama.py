"""The Llama family (Llama 2/3, Mistral, Qwen2) as one module tree. q/k/v and gate/up are
fused; every op outside the dense GEMMs goes through the op set (`loraplex.kernels`), and each
projection adds its per-token LoRA delta when the batch carries adapters."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels import Ops
from loraplex.model.context import FloraRows, LoraSlotWeights, get_forward_context
from loraplex.model.model_config import ModelConfig
from loraplex.model.rope import cos_sin_cache

# Module groups that carry LoRA slot buffers, and the adapter modules each stacks.
LORA_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
IA3_FUSED_OUTPUT_GROUPS = ("qkv", "gate_up")
"""Groups whose IA3 output vectors the next kernel applies (rotary, the activation), read at
their page-table offsets, so that an IA3 adapter on them needs no expand."""
IA3_FUSED_INPUT_GROUPS = ("down",)
"""Groups whose IA3 input vector the activation kernel applies (its output is down's input)."""


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def project(layer: int, group: str, ops: Ops, x: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [num_tokens, in] @ weight.T + bias, each token through its adapter:
    - IA3 on o's or down's input scales the token's input first (steps that carry one);
    - FLoRA tokens (steps that carry one) get (W0 * (B A)) x = sum_k b_k * (W0 (a_k * x)): their
      rows a_k * x share the products with W0 with the batch's rows, then are combined;
    - the LoRA expand (steps that need it) adds s B A x and, for DoRA and IA3 slots, scales each
      output row in its epilogue (DoRA: magnitude / ||W0 + s B A||; IA3's output vectors).
    Every adapter weight and vector is read through the group's page tables (kernels/lora_paged.py).
    A step without adapters is one product; LoRA and DoRA add two launches; FLoRA two more
    (stack, combine) around taller products."""
    lora = get_forward_context().lora
    if lora is None:
        return ops.linear(x, weight, bias)
    w = lora.buffers.group(layer, group)
    slots = lora.token_slots
    if lora.has_input_scale and w.in_scale_at is not None and group not in IA3_FUSED_INPUT_GROUPS:
        x = ops.scale_rows_paged(x, w.vectors, w.in_scale_at, slots)
    if lora.flora is None:
        y = ops.linear(x, weight, bias)
    else:
        y = _flora_project(ops, x, weight, bias, w, slots, lora.flora)
    if not lora.has_expand:
        return y
    shrunk = ops.lora_shrink_paged(x, w.pool, w.a_pages, slots, w.ranks, w.max_rank, lora.split)
    return ops.lora_expand_paged(y, shrunk, w.pool, w.b_pages, slots, w.ranks, w.slice_offsets, w.vectors,
                                 w.scale_at, w.shift_at, lora.split)


FLORA_FUSED_MAX_ROWS = 256
"""A fused group (q/k/v, gate/up) multiplies FLoRA's rows through the whole fused weight while
that makes at most this many rows, else each slice of the weight on the batch's rows and its own
FLoRA rows. Measured on the H100 (Llama-3-8B, bf16, cuBLAS, one layer's products from a CUDA
graph, bench/results/flora-products-nvidia-h100-80gb-hbm3.json): batch 16, rank 4 (qkv 208 rows fused)
fused 180 us a layer, per slice 183 (none 164); batch 64, rank 4 (qkv 832 fused, 320 per slice)
376 against 247; batch 16, rank 16: 345 against 245."""


def _flora_project(ops: Ops, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   w: LoraSlotWeights, slots: torch.Tensor, f: FloraRows) -> torch.Tensor:
    """x @ weight.T + bias with FLoRA's tokens through W0 * (B A) (see project)."""
    num_tokens, num_rows, num_slices = x.shape[0], len(f.row_tokens), len(w.slice_offsets) - 1
    per_slice = num_slices > 1 and num_tokens + num_slices * num_rows > FLORA_FUSED_MAX_ROWS
    stacked = ops.flora_stack_paged(x, w.pool, w.a_pages, w.flora_ranks, f.row_tokens, f.row_slots,
                                    f.row_ranks, per_slice)
    if per_slice:  # slice s of the weight (a view) on x and slice s's rows, into one buffer
        block, offsets = num_tokens + num_rows, w.slice_offsets
        products = stacked.new_empty(block * offsets[-1])
        for s in range(num_slices):
            lo, hi = offsets[s], offsets[s + 1]
            torch.mm(stacked[s * block:(s + 1) * block], weight[lo:hi].t(),
                     out=products[block * lo:block * hi].view(block, hi - lo))
    else:
        products = ops.linear(stacked, weight).view(-1)
    return ops.flora_combine_paged(products, w.pool, w.b_pages, slots, w.flora_ranks, f.bounds,
                                   w.slice_offsets, num_rows, per_slice, bias)


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
        qkv = project(self.layer, "qkv", self.ops, x, self.qkv_weight, self.qkv_bias)  # [tokens, q + 2 kv]
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        kv_layer = context.kv_cache[:, self.layer]  # [num_blocks, 2, block_size, kv_heads, head_dim]
        ia3 = ()
        if context.lora is not None:  # IA3's q/k/v vectors at their offsets (an offset a token when none)
            w = context.lora.buffers.group(self.layer, "qkv")
            ia3 = (context.lora.token_slots, w.vectors, w.fused_scale_at)
        q = self.ops.rotary_store_kv(positions, q, k, v, cos_sin, kv_layer, meta.slot_mapping, *ia3)
        if context.queries is not None:
            context.queries.append(q)
        if meta.is_decode and meta.relay is not None:
            relay = meta.relay
            out = self.ops.relay_decode_attention(q, kv_layer, meta.block_tables, meta.seq_lens,
                                                  relay.prefix_lens, relay.members, relay.group_starts,
                                                  self.scale)
        elif meta.is_decode:
            out = self.ops.paged_decode_attention(q, kv_layer, meta.block_tables, meta.seq_lens, self.scale)
        else:
            out = self.ops.paged_attention(
                q, kv_layer, meta.block_tables, meta.query_start_loc, meta.seq_lens, self.scale,
                max_query_len=meta.max_query_len, query_positions=meta.query_positions,
            )
        out = out.reshape(num_tokens, self.q_size)
        return project(self.layer, "o", self.ops, out, self.o_weight, self.o_bias)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, ops: Ops) -> None:
        super().__init__()
        self.layer, self.ops = layer, ops
        self.gate_up_weight = _empty(2 * config.intermediate_size, config.hidden_size)
        self.down_weight = _empty(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = project(self.layer, "gate_up", self.ops, x, self.gate_up_weight)  # [tokens, 2 * inter]
        lora = get_forward_context().lora
        ia3 = ()
        if lora is not None:  # IA3's gate/up output and down input vectors at their offsets
            w, down = lora.buffers.group(self.layer, "gate_up"), lora.buffers.group(self.layer, "down")
            ia3 = (lora.token_slots, w.vectors, w.fused_scale_at, w.vectors, down.in_scale_at)
        hidden = self.ops.silu_and_mul(gate_up, *ia3)
        return project(self.layer, "down", self.ops, hidden, self.down_weight)


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

    def group_weights(self, layer: int, group: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight [out, in], bias or None) of a LoRA module group (LORA_GROUPS) in a layer."""
        decoder = self.layers[layer]
        return {
            "qkv": (decoder.attn.qkv_weight, decoder.attn.qkv_bias),
            "o": (decoder.attn.o_weight, decoder.attn.o_bias),
            "gate_up": (decoder.mlp.gate_up_weight, None),
            "down": (decoder.mlp.down_weight, None),
        }[group]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_rows, hidden_size] -> logits [num_rows, vocab_size] float32. The decode
        kernel (skinny GEMM, up to 64 rows on CUDA) writes its float32 sums unrounded: bf16
        logits near 6 are 0.03 apart, enough to tie or swap the top tokens. Past it, cuBLAS's
        16-bit logits are widened."""
        head = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        return self.ops.linear(hidden, head, out_dtype=torch.float32)

"""A tensor-parallel rank's model: the ordinary Llama-family model of its shard config (its
query heads, KV heads and intermediate rows, see sharding.py), with
- the outputs of o and down (partial sums over the rank's input columns) all-reduced: two
  all-reduces a layer; o's bias is held by rank 0 only (zero elsewhere) so it is added once;
- a vocabulary-parallel embedding: a rank looks up the ids in its rows, zeroes the others, and
  the rows are all-reduced (one all-reduce of [num_tokens, hidden] a step);
- a vocabulary-parallel LM head whose float32 logits are all-gathered, so that every rank holds
  the whole [rows, vocab] logits. All-gather rather than a gather to rank 0: every rank then
  samples the same tokens from the same logits (same seeds), so each rank's runner keeps the
  next step's input tokens on its own device (async scheduling) and no token broadcast follows
  the step; an all-gather moves the same bytes into each rank as a gather moves into rank 0,
  and NCCL captures it in a CUDA graph as it does the all-reduces. An all-reduce of zero-padded
  [rows, vocab] logits would move twice the bytes.

LoRA needs nothing more here: a rank's slot buffers have its shard config's shapes (column
groups: B's rows split, A whole; row groups: A's columns split, B whole, see loraplex/worker/adapters.py), so
the row groups' LoRA partial sums ride the base all-reduce."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels import Ops
from loraplex.model.llama import MLP, Attention, LlamaForCausalLM
from loraplex.model.model_config import ModelConfig
from loraplex.parallel.collectives import TensorParallelGroup
from loraplex.parallel.sharding import ShardLayout


class ParallelAttention(Attention):
    """Attention over the rank's heads; o's partial sums all-reduced."""

    def __init__(self, config: ModelConfig, layer: int, ops: Ops, group: TensorParallelGroup) -> None:
        super().__init__(config, layer, ops)
        self.group = group

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(positions, x, cos_sin))


class ParallelMLP(MLP):
    """The MLP over the rank's intermediate rows; down's partial sums all-reduced."""

    def __init__(self, config: ModelConfig, layer: int, ops: Ops, group: TensorParallelGroup) -> None:
        super().__init__(config, layer, ops)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


class ParallelLlamaForCausalLM(LlamaForCausalLM):
    """Rank `layout.rank`'s shard. `config` is the shard config (its vocab_size the whole
    vocabulary: `compute_logits` returns whole logits on every rank); `embed_tokens` and
    `lm_head` hold the rank's `layout.vocab_rows` rows."""

    def __init__(self, layout: ShardLayout, ops: Ops, max_positions: int, group: TensorParallelGroup) -> None:
        if (group.rank, group.world_size) != (layout.rank, layout.world_size):
            raise ValueError(f"layout of rank {layout.rank}/{layout.world_size} on group rank "
                             f"{group.rank}/{group.world_size}")
        shard = layout.shard_config
        super().__init__(shard, ops, max_positions)
        self.layout, self.group = layout, group
        for i, decoder in enumerate(self.layers):
            decoder.attn = ParallelAttention(shard, i, ops, group)
            decoder.mlp = ParallelMLP(shard, i, ops, group)
        self.embed_tokens = _empty(layout.vocab_rows, shard.hidden_size)
        if not shard.tie_word_embeddings:
            self.lm_head = _empty(layout.vocab_rows, shard.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> hidden [num_tokens, hidden_size] (the same on
        every rank)."""
        x = self.embed(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, self.cos_sin)
        x, _ = self.ops.fused_add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [num_tokens] -> [num_tokens, hidden_size]: each rank's rows for its ids,
        zero for the others, summed over the ranks."""
        local = input_ids - self.layout.rank * self.layout.vocab_rows
        inside = (local >= 0) & (local < self.layout.vocab_rows)
        x = F.embedding(torch.where(inside, local, 0), self.embed_tokens)
        return self.group.all_reduce(x.masked_fill_(~inside[:, None], 0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_rows, hidden_size] -> logits [num_rows, vocab_size] float32 on every rank
        (the rank's columns, all-gathered; the vocabulary's padding dropped)."""
        head = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        logits = self.group.all_gather_columns(self.ops.linear(hidden, head, out_dtype=torch.float32))
        vocab_size = self.config.vocab_size
        return logits if logits.shape[1] == vocab_size else logits[:, :vocab_size].contiguous()


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)

"""The forward context: what the model runner tells the layers about the batch (attention and
LoRA metadata, the KV cache). The one ambient state of the model, set only inside
`with forward_context(...)`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from loraplex.kernels.reference import LoneSplit


@dataclass
class RelayMetadata:
    """Sequences of a decode step that read a shared prefix once per group (see
    kernels/relay_attention.py)."""

    prefix_lens: torch.Tensor
    """[num_seqs] int32: tokens of the sequence's group prefix; 0 = in no group."""
    members: torch.Tensor
    """[num_seqs] int32: sequences, group by group."""
    group_starts: torch.Tensor
    """[num_seqs // 2 + 1] int32: group g owns members[group_starts[g]:group_starts[g + 1]]."""


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[num_tokens] int64: cache slot of each new token (negative = padding, not stored)."""
    block_tables: torch.Tensor
    """[num_seqs, max_blocks] int32."""
    query_start_loc: torch.Tensor
    """[num_seqs + 1] int32: sequence i owns new tokens query_start_loc[i]:query_start_loc[i+1]."""
    seq_lens: torch.Tensor
    """[num_seqs] int32: tokens of each sequence including the new ones."""
    max_query_len: int
    """Longest run of new tokens of one sequence; 1 means a pure decode step."""
    relay: RelayMetadata | None = None
    """Relay groups of a decode step (None: every sequence takes the plain path)."""
    query_positions: torch.Tensor | None = None
    """[num_tokens] int32: each new token's own position, ascending within its sequence (a
    blend's recompute of scattered tokens); None: a sequence's new tokens are its last ones."""

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1


class LoraSlotWeights(Protocol):
    """The page tables of one module group in one layer (see kernels/lora_paged.py and
    loraplex/engine/lora_weights.py)."""

    pool: torch.Tensor  # [pool elements]: the pool as the weights' dtype
    vectors: torch.Tensor  # [pool elements]: the pool as float32
    a_pages: torch.Tensor  # [num_slots, num_slices, max_pages] int64: A's rank pages
    b_pages: torch.Tensor  # [num_slots, num_slices, max_pages] int64: B transposed's rank pages
    ranks: torch.Tensor  # [num_slots, num_slices] int32: additive rank (LoRA, DoRA)
    flora_ranks: torch.Tensor  # [num_slots, num_slices] int32: FLoRA's rank
    scale_at: torch.Tensor  # [num_slots] int64: the per-row output scale in vectors; -1 = none
    shift_at: torch.Tensor | None  # [num_slots] int64 (groups with a bias): DoRA's shift
    in_scale_at: torch.Tensor | None  # [num_slots] int64 (o and down): IA3's input vector
    fused_scale_at: torch.Tensor | None  # [num_slots] int64 (qkv, gate_up): IA3's output vector,
    # applied by the rotary and activation kernels
    slice_offsets: tuple[int, ...]
    max_rank: int


class LoraBuffers(Protocol):
    def group(self, layer: int, name: str) -> LoraSlotWeights: ...


@dataclass
class FloraRows:
    """The rows that FLoRA tokens add to a step's base products: row j is rank component
    row_ranks[j] of token row_tokens[j] (each FLoRA token's components in turn). A graph's rows
    are padded to a fixed count: padding rows name token 0, slot 0 (FLoRA rank 0) and component 0."""

    row_tokens: torch.Tensor
    """[num_rows] int64."""
    row_slots: torch.Tensor
    """[num_rows] int32: the adapter slot of row_tokens[j] (padding rows: 0)."""
    row_ranks: torch.Tensor
    """[num_rows] int64: the rank component (padding rows: 0); a token's rows come in turn,
    component 0 first."""
    bounds: torch.Tensor
    """[num_tokens + 1] int64: token t's rows are bounds[t]:bounds[t + 1]."""


@dataclass
class LoraMetadata:
    token_slots: torch.Tensor
    """[num_tokens] int32: adapter slot of each token, 0 = none."""
    buffers: LoraBuffers
    has_input_scale: bool = False
    """Some token's adapter scales o's input (IA3; down's is the activation kernel's)."""
    has_expand: bool = True
    """Some token's adapter needs the LoRA shrink and expand (LoRA, DoRA, IA3 on o or down's
    output); IA3 on q/k/v, gate/up and down's input, and FLoRA, do not."""
    flora: FloraRows | None = None
    """Set when some token carries a FLoRA adapter."""
    split: LoneSplit | None = None
    """Ops.lone_split(token_slots): how every LoRA shrink and expand of the pass shares its tokens
    out (None: no split). Made once a forward pass by the model runner, inside a CUDA graph's
    capture where there is one."""


@dataclass
class ForwardContext:
    kv_cache: torch.Tensor
    """[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]."""
    attention: AttentionMetadata
    lora: LoraMetadata | None
    """None when no token of the batch has an adapter."""
    queries: list[torch.Tensor] | None = None
    """Where each attention layer puts its queries, rotated, [num_tokens, num_heads, head_dim]
    (a blend's probe reads them: loraplex/engine/blending.py); None: nowhere."""


_CONTEXT: ContextVar[ForwardContext | None] = ContextVar("loraplex_forward_context", default=None)


@contextmanager
def forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    token = _CONTEXT.set(context)
    try:
        yield context
    finally:
        _CONTEXT.reset(token)


def get_forward_context() -> ForwardContext:
    context = _CONTEXT.get()
    if context is None:
        raise RuntimeError("the model was called outside `with forward_context(...)`")
    return context

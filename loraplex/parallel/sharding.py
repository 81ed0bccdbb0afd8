"""Which part of every weight a tensor-parallel rank keeps (Megatron-style):
- q/k/v and gate/up are split by output rows (column-parallel): a rank keeps its query heads,
  its KV heads and its slice of the intermediate size, so attention and the activation run on
  the rank's own heads and rows with no communication;
- o and down are split by input columns (row-parallel): each rank's product is a partial sum,
  all-reduced (two all-reduces a layer);
- KV heads are split when there are at least as many as ranks, else each is replicated over
  `world_size / num_kv_heads` ranks (Llama-3-70B's 8 KV heads at TP=16 would hold 1 each);
- the embedding and the LM head are split by vocabulary rows, padded to a multiple of the ranks.

A rank's model is the ordinary model of its `shard_config` (its own counts of heads, KV heads
and intermediate size) with the vocabulary split on top (loraplex/parallel/model.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loraplex.errors import ModelLoadError
from loraplex.model.model_config import ModelConfig

COLUMN_GROUPS = ("qkv", "gate_up")
"""LoRA module groups whose base weight is split by output rows."""
ROW_GROUPS = ("o", "down")
"""LoRA module groups whose base weight is split by input columns (outputs all-reduced)."""

Range = tuple[int, int]


def check_tensor_parallel(config: ModelConfig, world_size: int) -> None:
    """Raise ModelLoadError unless `config` splits over `world_size` ranks (before anything is
    loaded)."""
    def refuse(what: str) -> ModelLoadError:
        return ModelLoadError(f"tensor_parallel_size {world_size} does not divide {what}",
                              param="tensor_parallel_size")

    if world_size < 1:
        raise ModelLoadError(f"tensor_parallel_size must be at least 1, got {world_size}",
                             param="tensor_parallel_size")
    if config.num_heads % world_size:
        raise refuse(f"the model's {config.num_heads} attention heads")
    kv = config.num_kv_heads
    if kv >= world_size and kv % world_size:
        raise refuse(f"the model's {kv} KV heads")
    if kv < world_size and world_size % kv:
        raise ModelLoadError(
            f"tensor_parallel_size {world_size} is not a multiple of the model's {kv} KV heads "
            f"(with fewer KV heads than ranks, each KV head is replicated over the same number "
            f"of ranks)", param="tensor_parallel_size")
    if config.intermediate_size % world_size:
        raise refuse(f"the model's intermediate size {config.intermediate_size}")


@dataclass(frozen=True)
class ShardLayout:
    """What rank `rank` of `world_size` keeps. Ranges are [start, end) in the full model's
    dimensions."""

    config: ModelConfig
    """The full model."""
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        check_tensor_parallel(self.config, self.world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} out of range 0..{self.world_size - 1}")

    @property
    def num_heads(self) -> int:
        return self.config.num_heads // self.world_size

    @property
    def num_kv_heads(self) -> int:
        return max(self.config.num_kv_heads // self.world_size, 1)

    @property
    def kv_replicas(self) -> int:
        """Ranks that hold the same KV heads (1: split)."""
        return max(self.world_size // self.config.num_kv_heads, 1)

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.world_size

    @property
    def vocab_rows(self) -> int:
        """Embedding and LM head rows a rank holds (the vocabulary padded to a multiple of the
        ranks; padding rows are zero and their logits dropped)."""
        return -(-self.config.vocab_size // self.world_size)

    @property
    def vocab_range(self) -> Range:
        """The real token ids the rank's rows hold (the last rank's may be fewer than
        vocab_rows)."""
        start = self.rank * self.vocab_rows
        return min(start, self.config.vocab_size), min(start + self.vocab_rows, self.config.vocab_size)

    @property
    def q_range(self) -> Range:
        """Rows of q_proj (and columns of o_proj) the rank keeps."""
        size = self.num_heads * self.config.head_dim
        return self.rank * size, (self.rank + 1) * size

    @property
    def kv_range(self) -> Range:
        """Rows of k_proj and v_proj the rank keeps."""
        first_head = self.rank // self.kv_replicas * self.num_kv_heads
        size = self.num_kv_heads * self.config.head_dim
        return first_head * self.config.head_dim, first_head * self.config.head_dim + size

    @property
    def intermediate_range(self) -> Range:
        """Rows of gate_proj and up_proj (and columns of down_proj) the rank keeps."""
        return self.rank * self.intermediate_size, (self.rank + 1) * self.intermediate_size

    def slice_ranges(self, group: str) -> tuple[Range, ...]:
        """Per stacked module of a LoRA group (q, k, v / gate, up / o / down): the range the
        rank keeps of that module's output rows (column groups) or input columns (row groups),
        within the module."""
        return {
            "qkv": (self.q_range, self.kv_range, self.kv_range),
            "gate_up": (self.intermediate_range, self.intermediate_range),
            "o": (self.q_range,),
            "down": (self.intermediate_range,),
        }[group]

    def fused_ranges(self, group: str) -> tuple[Range, ...]:
        """slice_ranges offset into the group's fused dimension (q rows, then k, then v; gate
        then up), the rows or columns of the fused weight that the rank keeps, in order."""
        c = self.config
        starts = {"qkv": (0, c.q_size, c.q_size + c.kv_size),
                  "gate_up": (0, c.intermediate_size)}.get(group, (0,))
        return tuple((start + lo, start + hi) for start, (lo, hi) in zip(starts, self.slice_ranges(group)))

    @property
    def shard_config(self) -> ModelConfig:
        """The config of the rank's own model: its heads, KV heads and intermediate size (the
        vocabulary stays whole: logits come back whole, see ParallelLlamaForCausalLM)."""
        return dataclasses.replace(self.config, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                   intermediate_size=self.intermediate_size)

"""The collectives of a tensor-parallel model, over one torch.distributed process group (gloo
on CPU, NCCL on GPUs). Every rank calls the same collectives in the same order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    world_size: int
    group: Any = None
    """The torch.distributed process group (None: the default group)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, cols] on every rank -> [rows, world_size * cols], rank r's columns at
        r * cols (one flat all-gather, then a transpose)."""
        if self.world_size == 1:
            return x
        rows, cols = x.shape
        out = x.new_empty(self.world_size * rows * cols)
        _all_gather_flat(out, x.contiguous().view(-1), group=self.group)
        return out.view(self.world_size, rows, cols).permute(1, 0, 2).reshape(rows, self.world_size * cols)


def _all_gather_flat(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    """out [world_size * n] <- every rank's x [n], in rank order (all_gather_single from torch
    2.13 on, which deprecates all_gather_into_tensor)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)

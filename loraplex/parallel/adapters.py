"""A rank's shard of an adapter, laid out for its slot buffers (a HostAdapter of the full
model in, one of the rank's shard config out). The split follows the base layer, as vLLM's
default LoRA under tensor parallelism does:
- column groups (q/k/v, gate/up): B's rows (and IA3's output vectors) split with the base
  weight's rows, A whole: the shrink is repeated on every rank ([num_tokens, rank], small), the
  expand writes the rank's own rows;
- row groups (o, down): A's columns (and IA3's input vectors) split with the base weight's
  columns, B whole: each rank's shrink is a partial sum over its columns and its expand adds
  B times that partial to the base's partial output, so the one all-reduce that the base layer
  needs also sums the LoRA delta. No collective beyond the base model's.
S-LoRA also splits the column groups' A (then all-gathers the [num_tokens, rank] shrink) and
the row groups' B (then all-reduces the [num_tokens, rank] shrink before the expand): less
adapter memory per rank for one small collective each; not built yet.

FLoRA (W0 * B A) splits the same way: its rows of W0 * B A are the base weight's rows (column
groups) or its columns sum over the ranks (row groups). DoRA is refused: its row norms
||W0 + s B A|| of o and down run over input columns that are spread over the ranks."""

from __future__ import annotations

import torch

from loraplex.engine.lora_weights import HostAdapter
from loraplex.errors import AdapterError
from loraplex.parallel.sharding import COLUMN_GROUPS, ShardLayout

SUPPORTED_FAMILIES = ("lora", "ia3", "flora")


def check_adapter_family(family: str, world_size: int) -> None:
    """Raise AdapterError for a family that tensor parallelism does not serve yet (checked by
    the driver before any worker gets the adapter, and by each worker)."""
    if world_size > 1 and family not in SUPPORTED_FAMILIES:
        raise AdapterError(
            f"{family} adapters are not supported under tensor parallelism yet "
            f"(tensor_parallel_size {world_size}); supported: {', '.join(SUPPORTED_FAMILIES)}")


def shard_host_adapter(host: HostAdapter, layout: ShardLayout) -> HostAdapter:
    """Rank `layout.rank`'s part of `host` (made for the full model)."""
    check_adapter_family(host.family, layout.world_size)
    a, b = dict(host.a), dict(host.b)
    out_scale = None if host.out_scale is None else dict(host.out_scale)
    in_scale = None if host.in_scale is None else dict(host.in_scale)
    for group in host.a:
        index = _index(layout, group)
        if group in COLUMN_GROUPS:  # output rows
            b[group] = host.b[group].index_select(1, index)  # [L, out, r]
            if out_scale is not None:
                out_scale[group] = host.out_scale[group].index_select(1, index)  # [L, out]
        else:  # input columns
            a[group] = host.a[group].index_select(3, index)  # [L, slices, r, in]
            if in_scale is not None and group in in_scale:
                in_scale[group] = host.in_scale[group].index_select(1, index)  # [L, in]
    return HostAdapter(host.digest, host.rank, a, b, dict(host.ranks), host.family,
                       out_scale=out_scale, in_scale=in_scale)


def _index(layout: ShardLayout, group: str) -> torch.Tensor:
    """[kept] int64: the fused rows (column groups) or columns (row groups) the rank keeps."""
    return torch.cat([torch.arange(lo, hi) for lo, hi in layout.fused_ranges(group)])

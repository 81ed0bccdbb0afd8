"""A rank's shard of an adapter, laid out for its slot buffers (a HostAdapter of the full
model in, one of the rank's shard config out). The split follows the base layer, as vLLM's
default LoRA under tensor parallelism does:
- column groups (q/k/v, gate/up): B's rows (and IA3's output vectors, DoRA's magnitudes) split
  with the base weight's rows, A whole: the shrink is repeated on every rank
  ([num_tokens, rank], small), the expand writes the rank's own rows;
- row groups (o, down): A's columns (and IA3's input vectors) split with the base weight's
  columns, B whole: each rank's shrink is a partial sum over its columns and its expand adds
  B times that partial to the base's partial output, so the one all-reduce that the base layer
  needs also sums the LoRA delta. No collective beyond the base model's in a step.
S-LoRA also splits the column groups' A (then all-gathers the [num_tokens, rank] shrink) and
the row groups' B (then all-reduces the [num_tokens, rank] shrink before the expand): less
adapter memory per rank (Llama-3-8B at TP=2: 0.5 of the adapter a rank, against 0.675 here)
for two small collectives a module; not built yet.

FLoRA (W0 * B A) splits the same way: its rows of W0 * B A are the base weight's rows (column
groups) or its columns sum over the ranks (row groups). The output scales that IA3 and DoRA
apply to o and down scale each rank's partial sum, which sums to the scaled whole; DoRA's row
norms ||W0 + s B A|| of o and down run over input columns spread over the ranks, so their
squares are all-reduced when the adapter is loaded (`dora_row_scales`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from loraplex.engine.lora_weights import HostAdapter, PackedAdapter
from loraplex.parallel.collectives import TensorParallelGroup
from loraplex.parallel.sharding import COLUMN_GROUPS, ROW_GROUPS, ShardLayout

NORM_ROWS = 2048
"""Rows of W0 + s B A formed at a time for DoRA's norms (bounds the float32 temporary)."""


def shard_host_adapter(host: HostAdapter, layout: ShardLayout) -> HostAdapter:
    """Rank `layout.rank`'s part of `host` (made for the full model): `host` itself where one rank
    holds the whole model (a disaggregated side's worker), no copy made."""
    if layout.world_size == 1:
        return host
    a, b = dict(host.a), dict(host.b)
    vectors = {name: None if v is None else dict(v)
               for name, v in (("magnitude", host.magnitude), ("out_scale", host.out_scale),
                               ("in_scale", host.in_scale))}
    for group in host.a:
        index = _index(layout, group)
        if group in COLUMN_GROUPS:  # output rows
            b[group] = host.b[group].index_select(1, index)  # [L, out, r]
            for name in ("magnitude", "out_scale"):
                if vectors[name] is not None:
                    vectors[name][group] = vectors[name][group].index_select(1, index)  # [L, out]
        else:  # input columns
            a[group] = host.a[group].index_select(3, index)  # [L, slices, r, in]
            if vectors["in_scale"] is not None and group in vectors["in_scale"]:
                vectors["in_scale"][group] = vectors["in_scale"][group].index_select(1, index)  # [L, in]
    return HostAdapter(host.digest, host.rank, a, b, dict(host.ranks), host.family, **vectors)


class Inline:
    """A tensor that pickles by value, its bytes in the command itself, and unpickles as a plain
    tensor. Torch's reductions, which the workers' pipes use, put every CPU tensor they send in
    a shared-memory segment of its own and pass its file descriptor (a round trip each); a packed
    adapter's page tables and ranks are some forty small tensors, which took a 0.1 MB adapter's
    load into a worker from 3.4 ms to 15 ms on the CPU (studies/adapter_load_workers.py)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self):
        t = self.tensor.contiguous()
        return _from_bytes, (t.reshape(-1).view(torch.uint8).numpy(), t.dtype, tuple(t.shape))


def _from_bytes(data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(data).view(dtype).reshape(shape)


def packed_for_the_wire(host: HostAdapter, key: tuple, pages_in_ring: bool = False) -> HostAdapter:
    """What a load sends to a rank whose pool layout is `key` (host.packed[key] made already):
    the packed pages (in shared memory: their handle crosses; none where the driver wrote them
    into the rank's adapter ring, `pages_in_ring`), without A and B, the small tensors by value
    (Inline). Only for sending: its small tensors are Inline until unpickled."""
    packed = host.packed[key]
    pages = torch.empty(0, dtype=torch.uint8) if pages_in_ring else packed.pages

    def inline(tensors: dict[str, torch.Tensor] | None) -> dict | None:
        return None if tensors is None else {name: Inline(t) for name, t in tensors.items()}

    tables = {entry: (Inline(page), Inline(start)) for entry, (page, start) in packed.tables.items()}
    return dataclasses.replace(host, a={}, b={}, ranks=inline(host.ranks), magnitude=inline(host.magnitude),
                               out_scale=inline(host.out_scale), in_scale=inline(host.in_scale),
                               packed={key: PackedAdapter(pages, tables)})


def dora_row_scales(
    shard: HostAdapter, base_weights: Callable[[int, str], tuple[torch.Tensor, torch.Tensor | None]],
    group: TensorParallelGroup,
) -> dict[str, torch.Tensor]:
    """Row group -> DoRA's output scale [num_layers, out] float32 of a DoRA adapter's shard:
    magnitude / ||W0 + s B A|| per row where the layer is adapted, 1 elsewhere; the squared
    norms over each rank's columns all-reduced (every rank calls this for the same adapter)."""
    scales = {}
    for name in ROW_GROUPS:
        ranks = shard.ranks[name][:, 0].tolist()  # one slice: o, down
        device = base_weights(0, name)[0].device
        magnitude = shard.magnitude[name].float().to(device)  # [L, out]
        squares = torch.zeros_like(magnitude)
        for layer, r in enumerate(ranks):
            if r == 0:
                continue
            weight = base_weights(layer, name)[0]  # [out, in / world_size]
            a = shard.a[name][layer, 0, :r].float().to(device)  # [r, in / world_size]
            b = shard.b[name][layer, :, :r].float().to(device)  # [out, r], scaling folded in
            for lo in range(0, len(weight), NORM_ROWS):
                hi = min(lo + NORM_ROWS, len(weight))
                squares[layer, lo:hi] = (weight[lo:hi].float() + b[lo:hi] @ a).square().sum(dim=1)
        group.all_reduce(squares)
        adapted = torch.tensor(ranks, device=device)[:, None] > 0
        scales[name] = torch.where(adapted, magnitude / squares.sqrt(), torch.ones_like(magnitude))
    return scales


def _index(layout: ShardLayout, group: str) -> torch.Tensor:
    """[kept] int64: the fused rows (column groups) or columns (row groups) the rank keeps."""
    return torch.cat([torch.arange(lo, hi) for lo, hi in layout.fused_ranges(group)])

"""Adapters in rank pages of the device pool (issue 27, step 2): how an adapter's weights are cut
into the rank pages that kernels/lora_paged.py reads through its page tables, how those pages
are packed into the pool's pages (KV blocks), and the tables that name them.

A rank page holds PAGE_RANK rows of one module: of A ([PAGE_RANK, in]) or of B transposed
([PAGE_RANK, width] of one slice). An adapter of rank r takes cdiv(r, PAGE_RANK) of each, so its
bytes follow its own rank, not `--max-lora-rank`. Rank pages (and the float32 vectors of DoRA and
IA3) are packed first-fit into whole pool pages of the adapter's own, aligned to PAGE_ALIGN and
never across a pool page, so evicting an adapter gives whole pool pages back to the KV cache."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from loraplex.kernels.reference import PAGE_RANK, num_rank_pages
from loraplex.model.llama import LORA_GROUPS
from loraplex.model.model_config import ModelConfig

PAGE_ALIGN = 256
"""Bytes each rank page and vector starts on within a pool page."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def place_blocks(sizes: Sequence[int], page_bytes: int) -> tuple[int, list[tuple[int, int]]]:
    """(pool pages needed, (page index, byte offset) of each block): blocks of `sizes` bytes
    packed first-fit into pages of page_bytes, each aligned to PAGE_ALIGN, none across a page."""
    if any(size > page_bytes for size in sizes):
        raise ValueError(f"a rank page of {max(sizes)} bytes does not fit a pool page of {page_bytes}")
    used: list[int] = []  # bytes taken in each page so far
    placed = []
    for size in sizes:
        starts = [_round_up(taken, PAGE_ALIGN) for taken in used]
        fits = [i for i, start in enumerate(starts) if start + size <= page_bytes]
        if fits:
            page, start = fits[0], starts[fits[0]]
        else:
            page, start = len(used), 0
            used.append(0)
        used[page] = start + size
        placed.append((page, start))
    return len(used), placed


def adapter_page_sizes(config: ModelConfig, rank: int, dtype: torch.dtype,
                       with_vectors: bool = False) -> list[int]:
    """Bytes of each rank page of an adapter of `rank` on every module, layer by layer (A's
    [PAGE_RANK, in], B transposed's [PAGE_RANK, width] of each slice), and with_vectors (DoRA,
    IA3) its float32 vectors: every group's output (and DoRA's shift where the group has a
    bias), o's and down's input."""
    from loraplex.engine.lora_weights import INPUT_SCALE_GROUPS, group_dims

    element = torch.empty((), dtype=dtype).element_size()
    has_bias = {"qkv": config.qkv_bias, "o": config.o_bias}
    sizes = []
    for _ in range(config.num_layers):
        for group in LORA_GROUPS:
            in_features, offsets = group_dims(config, group)
            for lo, hi in zip(offsets, offsets[1:]):
                sizes += [PAGE_RANK * in_features * element, PAGE_RANK * (hi - lo) * element] \
                    * num_rank_pages(rank)
            if with_vectors:
                sizes += [4 * offsets[-1]] * (2 if has_bias.get(group) else 1)  # scale (and DoRA's shift)
                if group in INPUT_SCALE_GROUPS:
                    sizes.append(4 * in_features)
    return sizes


def adapter_page_blocks(config: ModelConfig, dtype: torch.dtype, block_bytes: int) -> int:
    """KV blocks of block_bytes an adapter page takes: one, unless a rank page or vector is
    larger than a block (tiny models), then the fewest that hold the largest; such a page is a
    run of that many blocks, aligned to it."""
    return -(-max(adapter_page_sizes(config, PAGE_RANK, dtype, with_vectors=True)) // block_bytes)


def adapter_pool_pages(config: ModelConfig, rank: int, dtype: torch.dtype, page_bytes: int,
                       with_vectors: bool = False) -> int:
    """Pool pages (KV blocks of page_bytes) an adapter of `rank` on every module takes: its rank
    pages packed first-fit. Proportional to the rank (in steps of PAGE_RANK), up to the last,
    partly filled pool page; a slot of step 1 took max_lora_rank's worth for any adapter."""
    return place_blocks(adapter_page_sizes(config, rank, dtype, with_vectors), page_bytes)[0]


@dataclass
class PagedGroup:
    """One module group's page tables over num_slots slots (kernels/lora_paged.py's layout)."""

    a_pages: torch.Tensor
    """[num_slots, num_slices, max_pages] int64, elements of the pool as the weights' dtype."""
    b_pages: torch.Tensor
    """[num_slots, num_slices, max_pages] int64: slice s's B transposed."""
    scale_at: torch.Tensor
    """[num_slots] int64 into the pool as float32; -1: none."""
    shift_at: torch.Tensor
    """[num_slots] int64 into the pool as float32; -1: none."""
    in_scale_at: torch.Tensor
    """[num_slots] int64 into the pool as float32 (IA3's input vector); -1: none."""
    pages: list[list[int]]
    """The pool pages each slot holds (slot 0: none)."""


def page_slot_group(
    pool: torch.Tensor, page_bytes: int, take_page: Callable[[], int], lora_a: torch.Tensor,
    lora_bt: torch.Tensor, ranks: torch.Tensor, slice_offsets: tuple[int, ...],
    scale: torch.Tensor | None = None, shift: torch.Tensor | None = None,
    scaled: Sequence[bool] | None = None, in_scale: torch.Tensor | None = None,
    in_scaled: Sequence[bool] | None = None,
) -> PagedGroup:
    """Copy dense slot buffers of one group into rank pages of `pool` (a uint8 vector of pages
    of page_bytes), each slot into pool pages of its own from take_page(). lora_a [num_slots,
    num_slices, max_rank, in], lora_bt [num_slots, max_rank, out] (B transposed: FLoRA's slot
    layout, or lora_b.transpose(1, 2)), ranks [num_slots, num_slices]; scale, shift [num_slots,
    out] float32 for the slots that set `scaled`, in_scale [num_slots, in] float32 for those that
    set `in_scaled`. Slot 0 stays empty. Used by the tests and the
    paged-vs-slots benchmark; the engine packs a whole adapter the same way."""
    num_slots, num_slices, max_rank, in_features = lora_a.shape
    element = lora_a.element_size()
    weights, vectors = pool.view(lora_a.dtype), pool.view(torch.float32)
    widths = [hi - lo for lo, hi in zip(slice_offsets, slice_offsets[1:])]
    max_pages = num_rank_pages(max_rank)
    a_pages = torch.zeros(num_slots, num_slices, max_pages, dtype=torch.int64)
    b_pages = torch.zeros_like(a_pages)
    scale_at = torch.full((num_slots,), -1, dtype=torch.int64)
    shift_at, in_scale_at = scale_at.clone(), scale_at.clone()
    held: list[list[int]] = [[]]
    slot_ranks = ranks.tolist()
    for slot in range(1, num_slots):
        blocks = []  # (kind, slice, page p, source rows [n, row_len])
        for s, rank in enumerate(slot_ranks[slot]):
            for p in range(num_rank_pages(rank)):
                rows = slice(p * PAGE_RANK, min(rank, (p + 1) * PAGE_RANK))
                blocks.append(("a", s, p, lora_a[slot, s, rows]))
                blocks.append(("b", s, p, lora_bt[slot, rows, slice_offsets[s]:slice_offsets[s + 1]]))
        sizes = [PAGE_RANK * (in_features if kind == "a" else widths[s]) * element
                 for kind, s, _, _ in blocks]
        is_scaled = scaled is not None and scaled[slot]
        if is_scaled:
            blocks.append(("scale", 0, 0, scale[slot]))
            if shift is not None:
                blocks.append(("shift", 0, 0, shift[slot]))
            sizes += [4 * slice_offsets[-1]] * (len(blocks) - len(sizes))
        if in_scaled is not None and in_scaled[slot]:
            blocks.append(("in_scale", 0, 0, in_scale[slot]))
            sizes.append(4 * in_features)
        num_pages, placed = place_blocks(sizes, page_bytes)
        pages = [take_page() for _ in range(num_pages)]
        held.append(pages)
        for (kind, s, p, source), (page, start) in zip(blocks, placed):
            at = pages[page] * page_bytes + start
            if kind in ("a", "b"):
                table = a_pages if kind == "a" else b_pages
                table[slot, s, p] = at // element
                weights[at // element:at // element + source.numel()].copy_(source.reshape(-1))
            else:
                {"scale": scale_at, "shift": shift_at, "in_scale": in_scale_at}[kind][slot] = at // 4
                vectors[at // 4:at // 4 + source.numel()].copy_(source)
    device = pool.device
    return PagedGroup(a_pages.to(device), b_pages.to(device), scale_at.to(device), shift_at.to(device),
                      in_scale_at.to(device), held)

"""LoRA weights on the device: page tables over the memory pool that the KV cache shares (issue
27: an adapter takes pool pages for its own rank, never `--max-lora-rank` wide), and the
host-memory copy of each adapter they are filled from.

An adapter on the device sits in a table row ("slot": what a token names) and in pool pages of
its own, any pages, lent by the block manager. Its weights are rank pages (loraplex/engine/
adapter_pages.py): PAGE_RANK rows of one module's A ([PAGE_RANK, in]) or of one slice's B
transposed ([PAGE_RANK, width]; the scaling folded in for LoRA and DoRA, FLoRA's unscaled),
packed first-fit into its pool pages with its float32 vectors. Per group (qkv, o, gate_up,
down), over all layers, fixed-address tensors (CUDA-graph inputs) that kernels/lora_paged.py
reads:
  a_pages, b_pages [num_layers, num_slots + 1, num_slices, cdiv(max_rank, PAGE_RANK)] int64
              element offsets of each rank page into the pool viewed as the weights' dtype
  ranks       [num_layers, num_slots + 1, num_slices] int32   additive rank (LoRA, DoRA); 0 = none
  flora_ranks [num_layers, num_slots + 1, num_slices] int32   FLoRA's rank (its A and B pages)
  scale_at    [num_layers, num_slots + 1] int64   float32 offset of the slot's per-row output
              scale (DoRA's magnitude over the row norm, IA3's output vector); -1 = none
  shift_at    [num_layers, num_slots + 1] int64   groups with a bias: (1 - scale) * bias (DoRA)
  in_scale_at [num_layers, num_slots + 1] int64   o and down: IA3's input vector; -1 = none
  fused_scale_at [num_layers, num_slots + 1] int64   q/k/v and gate/up: IA3's output vector,
              which the rotary and activation kernels apply; -1 = none
IA3's vectors are applied through these offsets: q/k/v's and gate/up's outputs and down's input
by the rotary and activation kernels (no expand for them), o's and down's outputs by the
expand's epilogue, o's input by a row scaling before o.
Slot 0 stays empty: it means "no adapter". A DoRA slot's scale is computed when the adapter is
copied in, from the base weights (the row norms of W0 + s B A)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from loraplex.adapter_format import IA3_INPUT_MODULES, LoraAdapter
from loraplex.engine.adapter_pages import (
    PAGE_ALIGN,
    adapter_page_blocks,
    adapter_page_sizes,
    adapter_pool_pages,
    place_blocks,
)
from loraplex.kernels.reference import PAGE_RANK, num_rank_pages
from loraplex.model.llama import IA3_FUSED_INPUT_GROUPS, IA3_FUSED_OUTPUT_GROUPS, LORA_GROUPS
from loraplex.model.model_config import ModelConfig

INPUT_SCALE_GROUPS = tuple(g for g, modules in LORA_GROUPS.items() if set(modules) <= set(IA3_INPUT_MODULES))
"""Groups whose input an IA3 vector may scale (o, down)."""
FUSED_OUTPUT_GROUPS = IA3_FUSED_OUTPUT_GROUPS
"""Groups whose IA3 output vectors the next kernel applies (rotary, the activation), not the
expand (model/llama.py)."""
FUSED_INPUT_GROUPS = IA3_FUSED_INPUT_GROUPS
"""Groups whose IA3 input vector the activation kernel applies (model/llama.py)."""
DORA_NORM_ROWS = 2048
"""Rows of W0 + s B A formed at once when a DoRA adapter's row norms are computed."""

BaseWeights = Callable[[int, str], "tuple[torch.Tensor, torch.Tensor | None]"]
"""(layer, group) -> the base model's (weight [out, in], bias [out] or None) of that group."""


def group_dims(config: ModelConfig, group: str) -> tuple[int, tuple[int, ...]]:
    """(in_features, slice_offsets) of a module group."""
    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    return {
        "qkv": (h, (0, q, q + kv, q + 2 * kv)),
        "o": (q, (0, h)),
        "gate_up": (h, (0, i, 2 * i)),
        "down": (i, (0, h)),
    }[group]


def adapter_bytes(config: ModelConfig, rank: int, dtype: torch.dtype) -> int:
    """Bytes of one adapter of `rank` on every module (a slot of that rank, or the host copy of
    such an adapter)."""
    element = torch.empty((), dtype=dtype).element_size()
    total = 0
    for group, modules in LORA_GROUPS.items():
        in_features, offsets = group_dims(config, group)
        total += config.num_layers * rank * (len(modules) * in_features + offsets[-1])
    return total * element + _vector_bytes(config)


def _vector_bytes(config: ModelConfig) -> int:
    """Bytes of an adapter's float32 vectors (DoRA magnitudes, IA3 scales) on every module."""
    total = 0
    for group in LORA_GROUPS:
        in_features, offsets = group_dims(config, group)
        total += offsets[-1] + (in_features if group in INPUT_SCALE_GROUPS else 0)
    return 4 * config.num_layers * total


@dataclass
class SlotGroup:
    """One layer's view of one group's page tables (what the model's LoRA hook reads)."""

    pool: torch.Tensor
    """[pool elements] the pool as the weights' dtype."""
    vectors: torch.Tensor
    """[pool elements] the pool as float32."""
    a_pages: torch.Tensor
    b_pages: torch.Tensor
    ranks: torch.Tensor
    flora_ranks: torch.Tensor
    scale_at: torch.Tensor
    shift_at: torch.Tensor | None
    in_scale_at: torch.Tensor | None
    slice_offsets: tuple[int, ...]
    max_rank: int
    fused_scale_at: torch.Tensor | None = None
    """q/k/v and gate/up: IA3's output vectors, for the rotary and activation kernels."""


@dataclass(frozen=True)
class PackedAdapter:
    """An adapter's rank pages and vectors packed into pool pages on the host (pinned on CUDA):
    `pages` [num_pages * page_bytes] uint8, laid out as the pool will hold them, and `tables`
    (kind, group) -> (page, start): for every entry of the adapter's page-table rows (shaped as
    they are: a / b [num_layers, slices, rank pages], vectors [num_layers]), the index of the
    page among the adapter's and the byte offset in it; page -1 where the adapter has none. A
    load copies the pages and turns `tables` into pool offsets with a few tensor operations."""

    pages: torch.Tensor
    tables: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return self.pages.numel()


@dataclass
class HostAdapter:
    """An adapter laid out for slot copies, in host memory (pinned on CUDA). Per group:
    a [num_layers, num_slices, rank, in], b [num_layers, out, rank] (scaled),
    ranks [num_layers, num_slices]; `rank` is the adapter's largest rank. By family:
    DoRA's magnitude [num_layers, out] (rows of unadapted slices unused); IA3's output scale
    [num_layers, out] and input scale [num_layers, in] (o and down), 1 where not adapted;
    FLoRA's A and B in a and b, unscaled."""

    digest: str
    rank: int
    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]
    ranks: dict[str, torch.Tensor]
    family: str = "lora"
    magnitude: dict[str, torch.Tensor] | None = None
    out_scale: dict[str, torch.Tensor] | None = None
    in_scale: dict[str, torch.Tensor] | None = None
    packed: dict[tuple, PackedAdapter] = field(default_factory=dict)
    """The adapter as the pool's pages hold it, by (model config, dtype, page bytes): built off
    the engine's thread when the adapter enters the host tier (LoraSlotBuffers.prepare, on the
    adapter cache's load thread) or is added as an object, so that a load is whole-page copies
    from pinned memory. Counted in num_bytes: about the adapter's size again in host memory (to
    do: make the packed pages the host tier's only copy; DoRA's row norms and tensor-parallel
    shards read `a` and `b`)."""

    @property
    def num_bytes(self) -> int:
        tensors = [*self.a.values(), *self.b.values()]
        for vectors in (self.magnitude, self.out_scale, self.in_scale):
            tensors += list((vectors or {}).values())
        return (sum(t.numel() * t.element_size() for t in tensors)
                + sum(packed.num_bytes for packed in list(self.packed.values())))

    def scaled(self, group: str) -> torch.Tensor:
        """[num_layers] int32: the layers where this adapter scales the group's output rows."""
        if self.family == "dora":
            return (self.ranks[group] > 0).any(dim=1).to(torch.int32)
        if self.family == "ia3":
            return (self.out_scale[group] != 1).any(dim=1).to(torch.int32)
        return torch.zeros(len(self.ranks[group]), dtype=torch.int32)

    def input_scaled(self, group: str) -> torch.Tensor:
        """[num_layers] int32: the layers where this adapter scales the group's input (IA3)."""
        if self.in_scale is None or group not in self.in_scale:
            return torch.zeros(len(self.ranks[group]), dtype=torch.int32)
        return (self.in_scale[group] != 1).any(dim=1).to(torch.int32)

    @property
    def needs_expand(self) -> bool:
        """Whether a step with this adapter runs the LoRA shrink and expand: an additive rank
        (LoRA, DoRA), or an IA3 vector that no fused kernel applies (outputs of o and down,
        o's input)."""
        if self.family in ("lora", "dora"):
            return any(bool((r > 0).any()) for r in self.ranks.values())
        if self.family == "ia3":
            unfused = [g for g in self.ranks if g not in FUSED_OUTPUT_GROUPS]
            return any(bool(self.scaled(g).any()) for g in unfused) or \
                any(bool(self.input_scaled(g).any()) for g in (self.in_scale or {})
                    if g not in FUSED_INPUT_GROUPS)
        return False


def make_host_adapter(
    adapter: LoraAdapter, config: ModelConfig, dtype: torch.dtype, pin: bool
) -> HostAdapter:
    rank, family, num_layers = adapter.rank, adapter.family, config.num_layers
    a, b, ranks, magnitude, out_scale, in_scale = {}, {}, {}, {}, {}, {}
    for group, modules in LORA_GROUPS.items():
        in_features, offsets = group_dims(config, group)
        a_g = torch.zeros(num_layers, len(modules), rank, in_features, dtype=dtype, pin_memory=pin)
        b_g = torch.zeros(num_layers, offsets[-1], rank, dtype=dtype, pin_memory=pin)
        r_g = torch.zeros(num_layers, len(modules), dtype=torch.int32)
        m_g = torch.ones(num_layers, offsets[-1], dtype=torch.float32)
        for (layer, name), module in adapter.modules.items():
            if name not in modules:
                continue
            s = modules.index(name)
            r = module.rank
            a_g[layer, s, :r] = torch.from_numpy(module.a)
            b_g[layer, offsets[s]:offsets[s + 1], :r] = torch.from_numpy(module.b * module.scaling)
            r_g[layer, s] = r
            if module.magnitude is not None:
                m_g[layer, offsets[s]:offsets[s + 1]] = torch.from_numpy(module.magnitude)
        a[group], b[group], ranks[group], magnitude[group] = a_g, b_g, r_g, m_g
        if family == "ia3":
            out_scale[group] = torch.ones(num_layers, offsets[-1], dtype=torch.float32)
            if group in INPUT_SCALE_GROUPS:
                in_scale[group] = torch.ones(num_layers, in_features, dtype=torch.float32)
            for (layer, name), vector in adapter.vectors.items():
                if name not in modules:
                    continue
                values = torch.from_numpy(vector.values)
                if vector.is_input:
                    in_scale[group][layer] = values
                else:
                    s = modules.index(name)
                    out_scale[group][layer, offsets[s]:offsets[s + 1]] = values
    host = HostAdapter(adapter.digest, rank, a, b, ranks, family,
                       magnitude=magnitude if family == "dora" else None,
                       out_scale=out_scale or None, in_scale=in_scale or None)
    if pin:  # (pinned blocks come back to torch's host allocator and serve the next adapters)
        for name in ("ranks", "magnitude", "out_scale", "in_scale"):
            tensors = getattr(host, name)
            if tensors is not None:
                setattr(host, name, {g: t.pin_memory() for g, t in tensors.items()})
    return host


SLOT_ALIGN = 256
"""Bytes each tensor of a step-1 slot started on (the baseline paged adapters are measured against)."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def pool_slot_bytes(config: ModelConfig, max_rank: int, dtype: torch.dtype, page_bytes: int) -> int:
    """Bytes a fixed slot of step 1 took in a pool of `page_bytes` pages (any adapter, `max_rank`
    wide, its vectors included), whole pages: the baseline that paged adapters are compared to."""
    element = torch.empty((), dtype=dtype).element_size()
    has_bias = {"qkv": config.qkv_bias, "o": config.o_bias}
    num_bytes = 0
    for group, modules in LORA_GROUPS.items():
        in_features, offsets = group_dims(config, group)
        sizes = [len(modules) * max_rank * in_features * element, offsets[-1] * max_rank * element,
                 offsets[-1] * 4]
        sizes += [offsets[-1] * 4] if has_bias.get(group) else []
        sizes += [in_features * 4] if group in INPUT_SCALE_GROUPS else []
        for size in sizes:
            num_bytes = _round_up(num_bytes + config.num_layers * size, SLOT_ALIGN)
    return _round_up(num_bytes, page_bytes)


def max_adapter_pool_bytes(config: ModelConfig, max_rank: int, dtype: torch.dtype, block_bytes: int) -> int:
    """Bytes (whole KV blocks of block_bytes) the largest adapter takes: `max_rank` on every
    module, with vectors, in adapter pages (adapter_page_blocks blocks each)."""
    page_bytes = adapter_page_blocks(config, dtype, block_bytes) * block_bytes
    return adapter_pool_pages(config, max_rank, dtype, page_bytes, with_vectors=True) * page_bytes


@dataclass(frozen=True)
class _Block:
    """One rank page or vector of an adapter on the device."""

    kind: str  # "a", "b", "scale", "shift", "in_scale"
    layer: int
    group: str
    slice: int = 0
    page: int = 0  # rank page
    size: int = 0  # bytes


def adapter_blocks(config: ModelConfig, dtype: torch.dtype, host: HostAdapter) -> list[_Block]:
    """The adapter's rank pages and vectors on the device, layer by layer, in the order they are
    packed: its own ranks' rank pages of every module it adapts; DoRA's scale (and shift, on
    groups with a bias) and IA3's vectors where it has them."""
    element = torch.empty((), dtype=dtype).element_size()
    has_bias = {"qkv": config.qkv_bias, "o": config.o_bias}
    blocks = []
    ranks = {g: host.ranks[g].tolist() for g in LORA_GROUPS}
    scaled = {g: host.scaled(g).tolist() for g in LORA_GROUPS}
    in_scaled = {g: host.input_scaled(g).tolist() for g in INPUT_SCALE_GROUPS}
    for layer in range(config.num_layers):
        for group in LORA_GROUPS:
            in_features, offsets = group_dims(config, group)
            for s, rank in enumerate(ranks[group][layer]):
                width = offsets[s + 1] - offsets[s]
                for p in range(num_rank_pages(rank)):
                    blocks.append(_Block("a", layer, group, s, p, PAGE_RANK * in_features * element))
                    blocks.append(_Block("b", layer, group, s, p, PAGE_RANK * width * element))
            if scaled[group][layer]:
                blocks.append(_Block("scale", layer, group, size=4 * offsets[-1]))
                if host.family == "dora" and has_bias.get(group):
                    blocks.append(_Block("shift", layer, group, size=4 * offsets[-1]))
            if group in in_scaled and in_scaled[group][layer]:
                blocks.append(_Block("in_scale", layer, group, size=4 * in_features))
    return blocks


def adapter_pages_for(config: ModelConfig, dtype: torch.dtype, page_bytes: int, host: HostAdapter) -> int:
    """Pool pages of page_bytes an adapter takes (its blocks packed first-fit)."""
    return _placement(tuple(b.size for b in adapter_blocks(config, dtype, host)), page_bytes)[0]


@functools.lru_cache(maxsize=64)
def _placement(sizes: tuple[int, ...], page_bytes: int) -> tuple[int, list[tuple[int, int]]]:
    """place_blocks, once for each shape of adapter (adapters of one rank and family share it)."""
    return place_blocks(sizes, page_bytes)


def _as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A host tensor's bytes as a numpy array, its last dimension in bytes (contiguous)."""
    return tensor.contiguous().view(torch.uint8).numpy()


@dataclass(frozen=True)
class _PackPlan:
    """How an adapter of one layout is packed (LoraSlotBuffers._pack_plan): its pages, and for
    each source the rows (of `unit` bytes) it gives and where they go in the pages."""

    num_pages: int
    unit: int
    """Bytes a row of the gathers: the greatest common divisor of every offset and length."""
    copies: dict[tuple, tuple[np.ndarray, np.ndarray]]
    """source -> (its rows, the pages' rows)."""
    gaps: np.ndarray
    """The pages' rows that no source fills (zeroed)."""
    tables: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]
    """(kind, group) -> (page, start) of each table entry (-1: none)."""


class LoraSlotBuffers:
    """The page tables of every layer and group over `pool` (a uint8 vector of pages of
    page_bytes that the KV cache shares), and on the host what each slot holds (its family,
    FLoRA rank, whether it scales an input) for the runner to plan steps by.

    An adapter page is `blocks_per_page` KV blocks of block_bytes (one, unless a rank page is
    larger than a block: tiny models), page p the pool's bytes [p * page_bytes, (p + 1) *
    page_bytes). `load(slot, adapter, pages)` writes the adapter's rank pages and vectors into
    the adapter pages it was lent (`pages_for(adapter)` of them) and fills its table rows; the
    tables' addresses never change (CUDA graphs stay valid). Without `pool`, the buffers get a
    pool of their own: num_slots adapters of max_rank, slot s on pages [(s - 1) * n, s * n)."""

    def __init__(
        self, config: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype,
        device: torch.device, base_weights: BaseWeights | None = None,
        pool: torch.Tensor | None = None, block_bytes: int | None = None,
    ) -> None:
        self.config, self.dtype = config, dtype
        self.num_slots, self.max_rank, self.device = num_slots, max_rank, torch.device(device)
        self.base_weights = base_weights
        """Needed to load DoRA adapters (their row norms); set once the model is built."""
        self.element = torch.empty((), dtype=dtype).element_size()
        if block_bytes is None:  # pages of one block each
            block_bytes = _round_up(max(adapter_page_sizes(config, PAGE_RANK, dtype, with_vectors=True)),
                                    PAGE_ALIGN)
        self.block_bytes = block_bytes
        self.blocks_per_page = adapter_page_blocks(config, dtype, block_bytes)
        self.page_bytes = page_bytes = self.blocks_per_page * block_bytes
        self.max_adapter_pages = adapter_pool_pages(config, max_rank, dtype, page_bytes, with_vectors=True)
        if pool is None:
            num_bytes = num_slots * self.max_adapter_pages * page_bytes
            pool = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        if (pool.dtype != torch.uint8 or pool.dim() != 1 or pool.numel() % block_bytes
                or block_bytes % PAGE_ALIGN):
            raise ValueError(f"the pool must be a uint8 vector of whole blocks of {block_bytes} bytes "
                             f"(a multiple of {PAGE_ALIGN})")
        self.pool = pool
        self.weights, self.vectors = pool.view(dtype), pool.view(torch.float32)
        self.pack_key = (repr(config), dtype, self.page_bytes)
        """HostAdapter.packed's key (a tensor-parallel rank's shard has a config of its own)."""
        self._plans: dict[tuple, _PackPlan] = {}  # layout of an adapter -> how it is packed
        L, S, max_pages = config.num_layers, num_slots + 1, num_rank_pages(max_rank)
        self.a_pages, self.b_pages, self.ranks, self.flora_ranks = {}, {}, {}, {}
        self.scale_at, self.shift_at, self.in_scale_at, self.fused_scale_at = {}, {}, {}, {}
        self.has_bias = {"qkv": config.qkv_bias, "o": config.o_bias}
        self._views: list[dict[str, SlotGroup]] = [{} for _ in range(L)]
        for group, modules in LORA_GROUPS.items():
            _, offsets = group_dims(config, group)
            pages = torch.zeros(L, S, len(modules), max_pages, dtype=torch.int64, device=device)
            self.a_pages[group], self.b_pages[group] = pages, torch.zeros_like(pages)
            self.ranks[group] = torch.zeros(L, S, len(modules), dtype=torch.int32, device=device)
            self.flora_ranks[group] = torch.zeros_like(self.ranks[group])
            self.scale_at[group] = torch.full((L, S), -1, dtype=torch.int64, device=device)
            if self.has_bias.get(group):
                self.shift_at[group] = torch.full((L, S), -1, dtype=torch.int64, device=device)
            if group in INPUT_SCALE_GROUPS:
                self.in_scale_at[group] = torch.full((L, S), -1, dtype=torch.int64, device=device)
            if group in FUSED_OUTPUT_GROUPS:
                self.fused_scale_at[group] = torch.full((L, S), -1, dtype=torch.int64, device=device)
            for layer in range(L):
                shift, in_scale = self.shift_at.get(group), self.in_scale_at.get(group)
                fused = self.fused_scale_at.get(group)
                self._views[layer][group] = SlotGroup(
                    self.weights, self.vectors, self.a_pages[group][layer], self.b_pages[group][layer],
                    self.ranks[group][layer], self.flora_ranks[group][layer], self.scale_at[group][layer],
                    None if shift is None else shift[layer], None if in_scale is None else in_scale[layer],
                    offsets, max_rank, None if fused is None else fused[layer])
        # What each slot holds, on the host.
        self.slot_flora_rank = np.zeros(S, dtype=np.int64)
        self.slot_input_scaled = np.zeros(S, dtype=bool)
        """The adapter scales o's or down's input (IA3): a step with it runs a row scaling."""
        self.slot_needs_expand = np.zeros(S, dtype=bool)
        """A step with the adapter runs the LoRA shrink and expand (HostAdapter.needs_expand)."""
        self.slot_family = ["lora"] * S

    def group(self, layer: int, name: str) -> SlotGroup:
        return self._views[layer][name]

    def own_pages_of(self, slot: int, count: int) -> list[int]:
        """The pages of `slot` in a pool of the buffers' own."""
        if count > self.max_adapter_pages:
            raise ValueError(f"an adapter of {count} pages does not fit a slot of {self.max_adapter_pages}")
        first = (slot - 1) * self.max_adapter_pages
        return list(range(first, first + count))

    def pages_for(self, host: HostAdapter) -> int:
        """Pool pages the adapter takes: its own ranks' rank pages and its vectors, packed."""
        packed = host.packed.get(self.pack_key)
        if packed is not None:
            return len(packed.pages) // self.page_bytes
        return adapter_pages_for(self.config, self.dtype, self.page_bytes, host)

    # Loads ----------------------------------------------------------------------------------
    def load(self, slot: int, host: HostAdapter, pages: list[int]) -> None:
        """Copy an adapter into pool `pages` (pages_for(host) of them) and point slot's table rows
        at them (asynchronous on CUDA from pinned memory); a DoRA adapter's row scales are
        computed on the device from the base weights."""
        if not 0 < slot <= self.num_slots:
            raise ValueError(f"slot {slot} out of range 1..{self.num_slots}")
        if host.family == "dora" and self.base_weights is None:
            raise ValueError("DoRA adapters need the base weights (base_weights is not set)")
        packed = self.prepare(host)
        pb = self.page_bytes
        num_pages = len(packed.pages) // pb
        if len(pages) < num_pages:  # (a rank's shard of an adapter may need fewer than the whole)
            raise ValueError(f"the adapter takes {num_pages} pages, got {len(pages)}")
        is_flora = host.family == "flora"
        # Each table entry's pool offset (elements of the dtype for rank pages, float32 for
        # vectors): the adapter's page mapped to the pool page it was lent, plus its start.
        lent = torch.tensor(pages[:num_pages] or [0], dtype=torch.int64) * pb
        tables = {}
        for (kind, group), (page, start) in packed.tables.items():
            at = lent[page.clamp(min=0)] + start
            tables[kind, group] = torch.where(page >= 0, at // (self.element if kind in ("a", "b") else 4),
                                              0 if kind in ("a", "b") else -1)
        # Whole pages, a run of consecutive pool pages a copy (one per page at worst): some tens
        # of copies an adapter, not one per rank page and vector (about a thousand on Llama-3-8B).
        first = 0
        for i in range(1, num_pages + 1):
            if i == num_pages or pages[i] != pages[i - 1] + 1:
                self.pool[pages[first] * pb:(pages[i - 1] + 1) * pb].copy_(
                    packed.pages[first * pb:i * pb], non_blocking=True)
                first = i
        device_tables = self._tables_by_kind()
        for (kind, group), table in tables.items():
            device_tables[kind][group][:, slot].copy_(table, non_blocking=True)
        for group in LORA_GROUPS:
            additive, flora = self.ranks[group][:, slot], self.flora_ranks[group][:, slot]
            (flora if is_flora else additive).copy_(host.ranks[group], non_blocking=True)
            (additive if is_flora else flora).zero_()
        if host.family == "dora":  # (offsets from the host tables: no sync with the copy stream)
            for group in LORA_GROUPS:
                shift_at = tables["shift", group].tolist() if group in self.shift_at else None
                self._write_row_scale(group, self._dora_scale(group, host), tables["scale", group].tolist(),
                                      shift_at)
        self.slot_family[slot] = host.family
        self.slot_flora_rank[slot] = host.rank if is_flora else 0
        self.slot_input_scaled[slot] = any(bool(host.input_scaled(g).any()) for g in INPUT_SCALE_GROUPS
                                           if g not in FUSED_INPUT_GROUPS)
        self.slot_needs_expand[slot] = host.needs_expand

    def _tables_by_kind(self) -> dict[str, dict[str, torch.Tensor]]:
        """kind -> group -> the device table of an adapter's entries of that kind (the groups
        that have one)."""
        return {"a": self.a_pages, "b": self.b_pages, "scale": self.scale_at, "shift": self.shift_at,
                "in_scale": self.in_scale_at, "fused_scale": self.fused_scale_at}

    def prepare(self, host: HostAdapter) -> PackedAdapter:
        """The adapter packed into pool-page layout for these buffers (built once, kept in
        host.packed): call it off the engine's thread, as the adapter cache's load thread does,
        so that `load` only copies."""
        packed = host.packed.get(self.pack_key)
        if packed is None:
            packed = host.packed[self.pack_key] = self._pack(host)
        return packed

    def _pack(self, host: HostAdapter) -> PackedAdapter:
        """The adapter's rank pages (A's rows, B's rows transposed) and IA3's vectors written into
        pool pages on the host, and where each table entry points; DoRA's row scales are
        computed on the device at each load. A few numpy gathers, one per source (_PackPlan, made
        once for each layout of adapter), so that the load thread holds the GIL for little of
        it: block by block (about a thousand on Llama-3-8B) its Python took the GIL from the
        engine's thread at every switch interval."""
        plan = self._pack_plan(host)
        pages = torch.empty(plan.num_pages * self.page_bytes, dtype=torch.uint8,
                            pin_memory=self.device.type == "cuda")
        unit = plan.unit
        out = pages.numpy().reshape(-1, unit)
        sources = self._pack_sources(host)
        for key, (src, dst) in plan.copies.items():
            out[dst] = sources[key].reshape(-1, unit)[src]
        out[plan.gaps] = 0  # (a pinned block from torch's cache holds an earlier adapter)
        tables = {key: (torch.from_numpy(page_of.copy()), torch.from_numpy(start_of.copy()))
                  for key, (page_of, start_of) in plan.tables.items()}
        return PackedAdapter(pages, tables)

    def _pack_sources(self, host: HostAdapter) -> dict[tuple, np.ndarray]:
        """Each source as bytes with a rank page's rows contiguous: A [L, slices, rank, in * e],
        B transposed per slice [L, rank, width * e], IA3's vectors [L, n * 4]."""
        sources: dict[tuple, np.ndarray] = {("a", g): _as_bytes(a) for g, a in host.a.items()}
        for g, b in host.b.items():
            _, offsets = group_dims(self.config, g)
            for s, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
                sources["b", g, s] = _as_bytes(b[:, lo:hi].transpose(1, 2))
        sources.update({("out_scale", g): _as_bytes(v) for g, v in (host.out_scale or {}).items()})
        sources.update({("in_scale", g): _as_bytes(v) for g, v in (host.in_scale or {}).items()})
        return sources

    def _pack_plan(self, host: HostAdapter) -> _PackPlan:
        """Where each of the adapter's bytes goes in its pages, and its table entries: the same
        for every adapter of one family, ranks and vectors (kept for the next)."""
        ranks = {g: r.tolist() for g, r in host.ranks.items()}
        key = (host.family, host.rank, tuple((g, str(r)) for g, r in ranks.items()),
               tuple(str(host.scaled(g).tolist()) for g in LORA_GROUPS),
               tuple(str(host.input_scaled(g).tolist()) for g in INPUT_SCALE_GROUPS))
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        blocks = adapter_blocks(self.config, self.dtype, host)
        num_pages, placed = _placement(tuple(b.size for b in blocks), self.page_bytes)
        L, max_pages = self.config.num_layers, num_rank_pages(self.max_rank)
        tables = {}
        for kind, by_group in self._tables_by_kind().items():
            for group in by_group:
                shape = (L, len(LORA_GROUPS[group]), max_pages) if kind in ("a", "b") else (L,)
                tables[kind, group] = (np.full(shape, -1, dtype=np.int64), np.zeros(shape, dtype=np.int64))
        rank, element = host.rank, self.element
        row_bytes = {}  # source -> bytes of one row (a rank row, or a layer's vector)
        for g in host.a:
            in_features, offsets = group_dims(self.config, g)
            row_bytes["a", g] = in_features * element
            for s, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
                row_bytes["b", g, s] = (hi - lo) * element
        is_ia3 = host.family == "ia3"
        runs: dict[tuple, list[tuple[int, int, int]]] = {}  # source -> (source byte, out byte, bytes)
        for block, (page, start) in zip(blocks, placed):
            at, g, layer = page * self.page_bytes + start, block.group, block.layer
            source = None
            if block.kind in ("a", "b"):
                entry, kind = (layer, block.slice, block.page), block.kind
                lo = block.page * PAGE_RANK
                hi = min(ranks[g][layer][block.slice], lo + PAGE_RANK)
                if kind == "a":
                    source = ("a", g)
                    num_slices = len(LORA_GROUPS[g])
                    first_row = (layer * num_slices + block.slice) * rank + lo
                else:
                    source = ("b", g, block.slice)
                    first_row = layer * rank + lo
                width = row_bytes[source]
                runs.setdefault(source, []).append((first_row * width, at, (hi - lo) * width))
            else:
                entry, kind = layer, block.kind
                if kind == "scale" and is_ia3:
                    source = ("out_scale", g)
                    if g in FUSED_OUTPUT_GROUPS:  # q/k/v and gate/up: for the rotary and activation kernels
                        kind = "fused_scale"
                elif kind == "in_scale":
                    source = ("in_scale", g)
                if source is not None:
                    size = block.size
                    runs.setdefault(source, []).append((layer * size, at, size))
            page_of, start_of = tables[kind, g]
            page_of[entry], start_of[entry] = page, start
        total = num_pages * self.page_bytes
        unit = functools.reduce(math.gcd, [total, *(n for rs in runs.values() for r in rs for n in r)])
        copies, covered = {}, np.zeros(total // unit, dtype=bool)
        for source, rs in runs.items():
            src_start, dst_start, length = (np.array(column, dtype=np.int64) // unit for column in zip(*rs))
            within = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
            src, dst = np.repeat(src_start, length) + within, np.repeat(dst_start, length) + within
            copies[source] = (src, dst)
            covered[dst] = True
        plan = self._plans[key] = _PackPlan(num_pages, unit, copies, np.flatnonzero(~covered), tables)
        return plan

    def set_row_scale(self, slot: int, group: str, scale: torch.Tensor) -> None:
        """scale [num_layers, out] float32 into the slot's output scale vectors of `group` (the
        layers that have one), and (1 - scale) * bias into its shift vectors."""
        shift_at = self.shift_at[group][:, slot].tolist() if group in self.shift_at else None
        self._write_row_scale(group, scale, self.scale_at[group][:, slot].tolist(), shift_at)

    def _write_row_scale(self, group: str, scale: torch.Tensor, scale_at: list[int],
                         shift_at: list[int] | None) -> None:
        for layer, at in enumerate(scale_at):
            if at < 0:
                continue
            row = scale[layer].to(self.device, torch.float32)
            self.vectors[at:at + len(row)].copy_(row)
            if shift_at is not None and shift_at[layer] >= 0:
                bias = self.base_weights(layer, group)[1].float()
                self.vectors[shift_at[layer]:shift_at[layer] + len(row)].copy_((1 - row) * bias)

    def _dora_scale(self, group: str, host: HostAdapter) -> torch.Tensor:
        """[num_layers, out] float32 on the device: magnitude / ||W0 + s B A|| per output row of
        each adapted slice, 1 elsewhere (A and B as the slot holds them: the adapter's dtype)."""
        _, offsets = group_dims(self.config, group)
        magnitude = host.magnitude[group].to(self.device, non_blocking=True)
        scale = torch.ones_like(magnitude)
        for layer, layer_ranks in enumerate(host.ranks[group].tolist()):
            weight = self.base_weights(layer, group)[0]  # [out, in]
            for s, r in enumerate(layer_ranks):
                if r == 0:
                    continue
                a = host.a[group][layer, s, :r].to(self.device).float()  # [r, in]
                for lo in range(offsets[s], offsets[s + 1], DORA_NORM_ROWS):
                    hi = min(lo + DORA_NORM_ROWS, offsets[s + 1])
                    b = host.b[group][layer, lo:hi, :r].to(self.device).float()  # [rows, r], scaled
                    norm = torch.linalg.vector_norm(weight[lo:hi].float() + b @ a, dim=1)
                    scale[layer, lo:hi] = magnitude[layer, lo:hi] / norm
        return scale

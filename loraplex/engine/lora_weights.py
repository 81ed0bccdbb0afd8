"""LoRA weights on the device: slot buffers per layer and module group, views into the memory
pool that the KV cache shares (fixed addresses, so CUDA graphs stay valid), and the host-memory
copy of each adapter they are filled from.

Per group (qkv, o, gate_up, down), over all layers:
  a           [num_layers, num_slots + 1, num_slices, max_rank, in_features]
  b           [num_layers, num_slots + 1, out_features, max_rank]   scaling folded in; a FLoRA
              slot holds its B transposed there ([max_rank, out_features] in the same memory:
              the combine reads a component's row for a token, not every column's max_rank)
  ranks       [num_layers, num_slots + 1, num_slices] int32   additive rank (LoRA, DoRA); 0 = none
  flora_ranks [num_layers, num_slots + 1, num_slices] int32   FLoRA's rank (its A and B sit in a, b)
  scale       [num_layers, num_slots + 1, out_features] float32   per-row output scale (DoRA's
              magnitude over the row norm, IA3's output vector), read where `scaled` is set
  scaled      [num_layers, num_slots + 1] int32              1 = the expand applies scale (and shift)
  fused_scaled [num_layers, num_slots + 1] int32   qkv and gate_up only: 1 = the kernel that reads
              the group's output applies scale (IA3's vector: rotary for qkv, the activation for
              gate_up), so an IA3 step need not run the expand
  shift       [num_layers, num_slots + 1, out_features] float32   groups with a bias only:
              (1 - scale) * bias, so that DoRA scales the product and not the bias
  in_scale    [num_layers, num_slots + 1, in_features] float32   o and down only: IA3's input
              vector (1 elsewhere); the activation kernel applies down's, a row scaling o's
  in_scaled   [num_layers, num_slots + 1] int32   down only: 1 = the activation applies in_scale
a, b, scale, shift and in_scale are views into the pool (slot s in the pool's bytes
[s * slot_bytes, (s + 1) * slot_bytes)); the int32 flags are small dense tensors of their own.
Slot 0 stays empty: it means "no adapter". A DoRA slot's scale is computed when the adapter is
copied in, from the base weights (the row norms of W0 + s B A)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from loraplex.adapter_format import IA3_INPUT_MODULES, LoraAdapter
from loraplex.model.llama import LORA_GROUPS
from loraplex.model.model_config import ModelConfig

INPUT_SCALE_GROUPS = tuple(g for g, modules in LORA_GROUPS.items() if set(modules) <= set(IA3_INPUT_MODULES))
"""Groups whose input an IA3 vector may scale (o, down)."""
FUSED_OUTPUT_GROUPS = ("qkv", "gate_up")
"""Groups whose IA3 output vectors the next kernel applies (rotary, the activation), not the expand."""
FUSED_INPUT_GROUPS = ("down",)
"""Groups whose IA3 input vector the activation kernel applies."""
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
    """One layer's view of one group's slot buffers (what the model's LoRA hook reads)."""

    a: torch.Tensor
    b: torch.Tensor
    ranks: torch.Tensor
    slice_offsets: tuple[int, ...]
    flora_ranks: torch.Tensor | None = None
    flora_b: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    scaled: torch.Tensor | None = None
    shift: torch.Tensor | None = None
    in_scale: torch.Tensor | None = None
    fused_scaled: torch.Tensor | None = None
    in_scaled: torch.Tensor | None = None


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

    @property
    def num_bytes(self) -> int:
        tensors = [*self.a.values(), *self.b.values()]
        for vectors in (self.magnitude, self.out_scale, self.in_scale):
            tensors += list((vectors or {}).values())
        return sum(t.numel() * t.element_size() for t in tensors)

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
        a_g = torch.zeros(num_layers, len(modules), rank, in_features, dtype=dtype)
        b_g = torch.zeros(num_layers, offsets[-1], rank, dtype=dtype)
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
    if pin:  # a pageable copy would block the host
        for name in ("a", "b", "ranks", "magnitude", "out_scale", "in_scale"):
            tensors = getattr(host, name)
            if tensors is not None:
                setattr(host, name, {g: t.pin_memory() for g, t in tensors.items()})
    return host


SLOT_ALIGN = 256
"""Bytes each slot tensor starts on (within a slot, and each slot within the pool)."""
POOLED_FIELDS = ("a", "b", "scale", "shift", "in_scale")
"""The per-slot tensors that live in the pool's bytes; the int32 flags stay dense tensors of
their own (the kernels read them as contiguous [num_slots] vectors), a few bytes a slot."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class SlotField:
    """One pooled tensor of one group: its shape below [num_layers, num_slots + 1], its dtype
    and where its first layer starts within a slot's bytes."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int

    @property
    def layer_bytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty((), dtype=self.dtype).element_size()


def slot_layout(
    config: ModelConfig, max_rank: int, dtype: torch.dtype
) -> tuple[dict[tuple[str, str], SlotField], int]:
    """((field, group) -> SlotField, bytes of one slot): a slot's tensors, one after another,
    each [num_layers, ...] and aligned to SLOT_ALIGN bytes."""
    has_bias = {"qkv": config.qkv_bias, "o": config.o_bias}
    fields, offset = {}, 0
    for group, modules in LORA_GROUPS.items():
        in_features, offsets = group_dims(config, group)
        shapes = {"a": ((len(modules), max_rank, in_features), dtype),
                  "b": ((offsets[-1], max_rank), dtype),
                  "scale": ((offsets[-1],), torch.float32)}
        if has_bias.get(group):
            shapes["shift"] = ((offsets[-1],), torch.float32)
        if group in INPUT_SCALE_GROUPS:
            shapes["in_scale"] = ((in_features,), torch.float32)
        for name, (shape, field_dtype) in shapes.items():
            field = SlotField(shape, field_dtype, offset)
            fields[name, group] = field
            offset = _round_up(offset + config.num_layers * field.layer_bytes, SLOT_ALIGN)
    return fields, offset


def pool_slot_bytes(config: ModelConfig, max_rank: int, dtype: torch.dtype, page_bytes: int) -> int:
    """Bytes a slot takes in a pool of `page_bytes` pages (KV blocks): its tensors rounded up
    to whole pages, and to SLOT_ALIGN."""
    _, num_bytes = slot_layout(config, max_rank, dtype)
    slot_bytes = _round_up(num_bytes, page_bytes)
    while slot_bytes % SLOT_ALIGN:
        slot_bytes += page_bytes
    return slot_bytes


class LoraSlotBuffers:
    """The device slot buffers of every layer and group, and on the host what each slot holds
    (its family, FLoRA rank, whether it scales an input) for the runner to plan steps by.

    Slot s's weights and vectors (a, b, scale, shift, in_scale) live in the bytes
    [s * slot_bytes, (s + 1) * slot_bytes) of `pool`, a uint8 buffer that the KV cache shares
    (the block manager lends a slot's pages to it while an adapter is resident);
    each is a strided view [num_layers, num_slots + 1, ...] whose slot stride is slot_bytes, so
    `t[layer]` and `t[:, slot]` read as dense slot buffers would, and the addresses never change
    (CUDA graphs stay valid). Without `pool`, the buffers get a pool of their own."""

    def __init__(
        self, config: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype,
        device: torch.device, base_weights: BaseWeights | None = None,
        pool: torch.Tensor | None = None, slot_bytes: int | None = None,
    ) -> None:
        self.num_slots, self.max_rank, self.device = num_slots, max_rank, torch.device(device)
        self.base_weights = base_weights
        """Needed to load DoRA adapters (their row norms); set once the model is built."""
        L, S = config.num_layers, num_slots + 1
        layout, num_bytes = slot_layout(config, max_rank, dtype)
        self.slot_bytes = slot_bytes or num_bytes
        if self.slot_bytes < num_bytes or self.slot_bytes % SLOT_ALIGN:
            raise ValueError(f"a slot needs {num_bytes} bytes, aligned to {SLOT_ALIGN}; "
                             f"got {self.slot_bytes}")
        if pool is None:
            pool = torch.zeros(S * self.slot_bytes, dtype=torch.uint8, device=device)
        if pool.dtype != torch.uint8 or pool.dim() != 1 or pool.numel() < S * self.slot_bytes:
            raise ValueError(f"the pool must be a uint8 vector of at least {S * self.slot_bytes} bytes")
        self.pool = pool
        self.a, self.b, self.ranks, self.flora_ranks = {}, {}, {}, {}
        self.scale, self.scaled, self.shift, self.in_scale = {}, {}, {}, {}
        self.fused_scaled, self.in_scaled = {}, {}
        for (name, group), field in layout.items():
            getattr(self, name)[group] = self._pooled(field, L, S)
        self._views: list[dict[str, SlotGroup]] = [{} for _ in range(L)]
        for group, modules in LORA_GROUPS.items():
            in_features, offsets = group_dims(config, group)
            self.ranks[group] = torch.zeros(L, S, len(modules), dtype=torch.int32, device=device)
            self.flora_ranks[group] = torch.zeros(L, S, len(modules), dtype=torch.int32, device=device)
            self.scaled[group] = torch.zeros(L, S, dtype=torch.int32, device=device)
            if group in FUSED_OUTPUT_GROUPS:
                self.fused_scaled[group] = torch.zeros(L, S, dtype=torch.int32, device=device)
            if group in FUSED_INPUT_GROUPS:
                self.in_scaled[group] = torch.zeros(L, S, dtype=torch.int32, device=device)
            for layer in range(L):
                views = {name: None if t is None else t[layer] for name, t in (
                    ("shift", self.shift.get(group)), ("in_scale", self.in_scale.get(group)),
                    ("fused_scaled", self.fused_scaled.get(group)),
                    ("in_scaled", self.in_scaled.get(group)))}
                b = self.b[group][layer]
                self._views[layer][group] = SlotGroup(
                    self.a[group][layer], b, self.ranks[group][layer], offsets,
                    flora_ranks=self.flora_ranks[group][layer],
                    flora_b=b.view(S, max_rank, offsets[-1]),
                    scale=self.scale[group][layer],
                    scaled=self.scaled[group][layer], **views)
        self._clear(0)  # slot 0, "no adapter", keeps its bytes for good
        # What each slot holds, on the host.
        self.slot_flora_rank = np.zeros(S, dtype=np.int64)
        self.slot_input_scaled = np.zeros(S, dtype=bool)
        """The adapter scales o's input (IA3): a step with it runs a row scaling on o."""
        self.slot_needs_expand = np.zeros(S, dtype=bool)
        """A step with the adapter runs the LoRA shrink and expand (HostAdapter.needs_expand)."""
        self.slot_family = ["lora"] * S

    def _pooled(self, field: SlotField, num_layers: int, num_slots: int) -> torch.Tensor:
        """[num_layers, num_slots, *field.shape]: a view of the pool, slot-major."""
        element = torch.empty((), dtype=field.dtype).element_size()
        flat = self.pool.view(field.dtype)
        dense = torch.empty(field.shape, device="meta").stride()
        layer = int(np.prod(field.shape))
        return flat.as_strided((num_layers, num_slots, *field.shape),
                               (layer, self.slot_bytes // element, *dense), field.offset // element)

    def _clear(self, slot: int) -> None:
        """Zero a slot's bytes (they may hold KV), then its vectors' neutral values."""
        self.pool[slot * self.slot_bytes:(slot + 1) * self.slot_bytes].zero_()
        for group in LORA_GROUPS:
            self.scale[group][:, slot].fill_(1.0)
            if group in self.in_scale:
                self.in_scale[group][:, slot].fill_(1.0)

    def group(self, layer: int, name: str) -> SlotGroup:
        return self._views[layer][name]

    def load(self, slot: int, host: HostAdapter) -> None:
        """Copy an adapter into a slot (asynchronous on CUDA from pinned memory); a DoRA
        adapter's row scales are computed on the device from the base weights."""
        if not 0 < slot <= self.num_slots:
            raise ValueError(f"slot {slot} out of range 1..{self.num_slots}")
        if host.family == "dora" and self.base_weights is None:
            raise ValueError("DoRA adapters need the base weights (base_weights is not set)")
        r, is_flora = host.rank, host.family == "flora"
        self._clear(slot)
        for group in LORA_GROUPS:
            self.a[group][:, slot, :, :r].copy_(host.a[group], non_blocking=True)
            if is_flora:  # B transposed: [max_rank, out] in the slot's memory
                b = self.b[group][:, slot]
                b.view(len(b), self.max_rank, -1)[:, :r].copy_(host.b[group].transpose(1, 2),
                                                               non_blocking=True)
            else:
                self.b[group][:, slot, :, :r].copy_(host.b[group], non_blocking=True)
            additive, flora = self.ranks[group][:, slot], self.flora_ranks[group][:, slot]
            (flora if is_flora else additive).copy_(host.ranks[group], non_blocking=True)
            (additive if is_flora else flora).zero_()
            is_fused = host.family == "ia3" and group in FUSED_OUTPUT_GROUPS
            self.scaled[group][:, slot].copy_(host.scaled(group) * (not is_fused), non_blocking=True)
            if group in self.fused_scaled:
                self.fused_scaled[group][:, slot].copy_(host.scaled(group) * is_fused, non_blocking=True)
            if group in self.in_scaled:
                self.in_scaled[group][:, slot].copy_(host.input_scaled(group), non_blocking=True)
            scale = self.scale[group][:, slot]
            if host.family == "ia3":
                scale.copy_(host.out_scale[group], non_blocking=True)
            elif host.family == "dora":
                self._dora_scale(slot, group, host)
            else:
                scale.fill_(1.0)
            if group in self.shift:
                bias = torch.stack([self.base_weights(layer, group)[1] for layer in range(len(scale))]) \
                    if host.family == "dora" else None
                shift = self.shift[group][:, slot]
                shift.copy_((1 - scale) * bias.float()) if bias is not None else shift.zero_()
            if group in self.in_scale:
                in_scale = self.in_scale[group][:, slot]
                if host.in_scale is not None:
                    in_scale.copy_(host.in_scale[group], non_blocking=True)
                else:
                    in_scale.fill_(1.0)
        self.slot_family[slot] = host.family
        self.slot_flora_rank[slot] = r if is_flora else 0
        self.slot_input_scaled[slot] = any(bool(host.input_scaled(g).any()) for g in INPUT_SCALE_GROUPS
                                           if g not in FUSED_INPUT_GROUPS)
        self.slot_needs_expand[slot] = host.needs_expand

    def _dora_scale(self, slot: int, group: str, host: HostAdapter) -> None:
        """scale[:, slot] <- magnitude / ||W0 + s B A|| per output row of each adapted slice
        (float32, on the device: the slot's A and B are already copied), 1 elsewhere."""
        scale = self.scale[group][:, slot]
        scale.fill_(1.0)
        magnitude = host.magnitude[group].to(self.device, non_blocking=True)
        ranks = host.ranks[group].tolist()
        offsets = self._views[0][group].slice_offsets
        for layer, layer_ranks in enumerate(ranks):
            weight = self.base_weights(layer, group)[0]  # [out, in]
            for s, r in enumerate(layer_ranks):
                if r == 0:
                    continue
                a = self.a[group][layer, slot, s, :r].float()  # [r, in]
                for lo in range(offsets[s], offsets[s + 1], DORA_NORM_ROWS):
                    hi = min(lo + DORA_NORM_ROWS, offsets[s + 1])
                    b = self.b[group][layer, slot, lo:hi, :r].float()  # [rows, r], scaling folded in
                    norm = torch.linalg.vector_norm(weight[lo:hi].float() + b @ a, dim=1)
                    scale[layer, lo:hi] = magnitude[layer, lo:hi] / norm

"""LoRA weights on the device: fixed slot buffers per layer and module group (fixed addresses,
so CUDA graphs stay valid), and the host-memory copy of each adapter they are filled from.

Per group (qkv, o, gate_up, down), over all layers:
  a     [num_layers, num_slots + 1, num_slices, max_rank, in_features]
  b     [num_layers, num_slots + 1, out_features, max_rank]   scaling folded in
  ranks [num_layers, num_slots + 1, num_slices] int32          0 = slice not adapted
Slot 0 stays empty: it means "no adapter"."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.adapter_format import LoraAdapter
from loraplex.model.llama import LORA_GROUPS
from loraplex.model.model_config import ModelConfig


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
    return total * element


@dataclass
class SlotGroup:
    """One layer's view of one group's slot buffers (what the model's LoRA hook reads)."""

    a: torch.Tensor
    b: torch.Tensor
    ranks: torch.Tensor
    slice_offsets: tuple[int, ...]


@dataclass
class HostAdapter:
    """An adapter laid out for slot copies, in host memory (pinned on CUDA). Per group:
    a [num_layers, num_slices, rank, in], b [num_layers, out, rank] (scaled),
    ranks [num_layers, num_slices]; `rank` is the adapter's largest rank."""

    digest: str
    rank: int
    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]
    ranks: dict[str, torch.Tensor]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))


def make_host_adapter(
    adapter: LoraAdapter, config: ModelConfig, dtype: torch.dtype, pin: bool
) -> HostAdapter:
    rank = adapter.rank
    a, b, ranks = {}, {}, {}
    for group, modules in LORA_GROUPS.items():
        in_features, offsets = group_dims(config, group)
        a_g = torch.zeros(config.num_layers, len(modules), rank, in_features, dtype=dtype)
        b_g = torch.zeros(config.num_layers, offsets[-1], rank, dtype=dtype)
        r_g = torch.zeros(config.num_layers, len(modules), dtype=torch.int32)
        for (layer, name), module in adapter.modules.items():
            if name not in modules:
                continue
            s = modules.index(name)
            r = module.rank
            a_g[layer, s, :r] = torch.from_numpy(module.a)
            b_g[layer, offsets[s]:offsets[s + 1], :r] = torch.from_numpy(module.b * module.scaling)
            r_g[layer, s] = r
        a[group], b[group], ranks[group] = a_g, b_g, r_g
    if pin:
        a = {g: t.pin_memory() for g, t in a.items()}
        b = {g: t.pin_memory() for g, t in b.items()}
        ranks = {g: t.pin_memory() for g, t in ranks.items()}  # a pageable copy would block the host
    return HostAdapter(adapter.digest, rank, a, b, ranks)


class LoraSlotBuffers:
    """The device slot buffers of every layer and group."""

    def __init__(
        self, config: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_slots, self.max_rank, self.device = num_slots, max_rank, torch.device(device)
        L, S = config.num_layers, num_slots + 1
        self.a, self.b, self.ranks = {}, {}, {}
        self._views: list[dict[str, SlotGroup]] = [{} for _ in range(L)]
        for group, modules in LORA_GROUPS.items():
            in_features, offsets = group_dims(config, group)
            self.a[group] = torch.zeros(L, S, len(modules), max_rank, in_features, dtype=dtype, device=device)
            self.b[group] = torch.zeros(L, S, offsets[-1], max_rank, dtype=dtype, device=device)
            self.ranks[group] = torch.zeros(L, S, len(modules), dtype=torch.int32, device=device)
            for layer in range(L):
                self._views[layer][group] = SlotGroup(
                    self.a[group][layer], self.b[group][layer], self.ranks[group][layer], offsets)

    def group(self, layer: int, name: str) -> SlotGroup:
        return self._views[layer][name]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))

    def load(self, slot: int, host: HostAdapter) -> None:
        """Copy an adapter into a slot (asynchronous on CUDA from pinned memory)."""
        if not 0 < slot <= self.num_slots:
            raise ValueError(f"slot {slot} out of range 1..{self.num_slots}")
        r = host.rank
        for group in LORA_GROUPS:
            self.a[group][:, slot, :, :r].copy_(host.a[group], non_blocking=True)
            self.b[group][:, slot, :, :r].copy_(host.b[group], non_blocking=True)
            self.ranks[group][:, slot].copy_(host.ranks[group], non_blocking=True)

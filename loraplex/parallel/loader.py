"""Load one tensor-parallel rank's shard of a Llama-family model from a local Hugging Face
folder: each rank reads only its rows or columns of each tensor (safetensors slices), never
the whole model."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from loraplex.errors import ModelLoadError
from loraplex.kernels import Ops
from loraplex.model.loader import _hf_names, weight_files
from loraplex.parallel.collectives import TensorParallelGroup
from loraplex.parallel.model import ParallelLlamaForCausalLM
from loraplex.parallel.sharding import ShardLayout


def load_model_shard(
    folder: str | Path, layout: ShardLayout, ops: Ops, dtype: torch.dtype, device: torch.device,
    max_positions: int, group: TensorParallelGroup,
) -> ParallelLlamaForCausalLM:
    """Build rank `layout.rank`'s model and fill it from the folder's safetensors files."""
    folder = Path(folder)
    with torch.device("meta"):
        model = ParallelLlamaForCausalLM(layout, ops, max_positions, group)
    model.to_empty(device=device)
    handles = [safe_open(str(path), framework="pt", device="cpu") for path in weight_files(folder)]
    located = {name: handle for handle in handles for name in handle.keys()}  # noqa: SIM118 (safe_open is no dict)
    params = dict(model.named_parameters(remove_duplicate=False))
    for ours, hf_names in _hf_names(layout.config).items():
        missing = [name for name in hf_names if name not in located]
        if missing:
            raise ModelLoadError(f"{folder}: tensor {missing[0]} is missing from the checkpoint")
        parts = [_read_shard(located[name], name, ours, index, layout) for index, name in enumerate(hf_names)]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        target = params[ours]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"{folder}: rank {layout.rank}'s shard of {', '.join(hf_names)} has shape "
                f"{list(tensor.shape)}, but config.json implies {list(target.shape)}")
        with torch.no_grad():
            target.data = tensor.to(device=device, dtype=dtype)
    model.reset_rope()
    return model.eval()


def _read_shard(handle, name: str, ours: str, index: int, layout: ShardLayout) -> torch.Tensor:
    """Rank `layout.rank`'s part of HF tensor `name`, the `index`-th part of our `ours`."""
    tensor = handle.get_slice(name)
    kind = ours.rsplit(".", 1)[-1]
    if kind in ("embed_tokens", "lm_head"):
        lo, hi = layout.vocab_range
        rows = tensor[lo:hi]
        padding = layout.vocab_rows - (hi - lo)
        return torch.cat([rows, rows.new_zeros(padding, rows.shape[1])]) if padding else rows
    if kind in ("qkv_weight", "qkv_bias", "gate_up_weight"):
        lo, hi = layout.slice_ranges("qkv" if kind.startswith("qkv") else "gate_up")[index]
        return tensor[lo:hi]
    if kind in ("o_weight", "down_weight"):
        lo, hi = layout.slice_ranges("o" if kind == "o_weight" else "down")[0]
        return tensor[:, lo:hi]
    if kind == "o_bias":  # added once, by rank 0, to the all-reduced sum
        whole = tensor[:]
        return whole if layout.rank == 0 else torch.zeros_like(whole)
    return tensor[:]  # norms: every rank keeps them whole

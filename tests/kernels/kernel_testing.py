"""Helpers for the kernel tests: the device to run on, poisoned guard regions around inputs,
poisoned allocations inside the wrappers, and error measures."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
gpu = pytest.mark.gpu
skip_without_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
# dtypes the interpreter computes correctly; bf16 is tested on the GPU.
INTERPRETER_DTYPES = (torch.float32, torch.float16)
POISON_INT = -7


def poison_value(dtype: torch.dtype) -> float | int:
    return float("nan") if dtype.is_floating_point else POISON_INT


def guarded_rows(t: torch.Tensor, pad: int = 5) -> torch.Tensor:
    """A copy of t [rows, cols] whose rows are `pad` poisoned elements apart, with a poisoned
    row before and after: any read past a row, or past the tensor, sees poison."""
    rows, cols = t.shape
    buf = torch.full((rows + 2, cols + pad), poison_value(t.dtype), dtype=t.dtype, device=t.device)
    view = buf[1:-1, :cols]
    view.copy_(t)
    return view


def guarded_1d(t: torch.Tensor, pad: int = 8) -> torch.Tensor:
    """A contiguous copy of the 1-D t with poison before and after it."""
    buf = torch.full((t.numel() + 2 * pad,), poison_value(t.dtype), dtype=t.dtype, device=t.device)
    view = buf[pad:pad + t.numel()]
    view.copy_(t)
    return view


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(poison_value(t.dtype))


class _PoisonTorch(types.SimpleNamespace):
    """Stands in for the torch module inside a kernel module: `empty` and `empty_like` return
    poisoned tensors, so an output element the kernel forgets to write shows up."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__()
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def empty(self, *args, **kwargs) -> torch.Tensor:
        return _poisoned(self._real.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs) -> torch.Tensor:
        return _poisoned(self._real.empty_like(*args, **kwargs))


@contextlib.contextmanager
def poisoned_allocations(module: types.ModuleType) -> Iterator[None]:
    """Within the block, the wrappers in `module` allocate poisoned outputs and scratch."""
    real = module.torch
    module.torch = _PoisonTorch(real)
    try:
        yield
    finally:
        module.torch = real


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN anywhere gives inf)."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    a, b = out.double().flatten(), ref.double().flatten()
    return (a @ b / (a.norm() * b.norm()).clamp_min(1e-30)).item()


def assert_close_bf16(out: torch.Tensor, ref: torch.Tensor, *, atol: float, rtol: float) -> None:
    assert torch.isfinite(out).all(), "non-finite values in the kernel output"
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def make_paged_kv(
    seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, device: torch.device | str, *, num_layers: int = 2, layer: int = 1,
    seed: int = 0, extra_blocks: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-major cache [num_blocks, num_layers, 2, block_size, kv_heads, head_dim] filled
    with NaN except each sequence's first seq_len tokens in `layer`, on shuffled blocks; and
    block_tables [num_seqs, max_blocks] int32 whose unused entries name block 0, all NaN.
    Returns (kv_layer view of `layer`, block_tables)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq + [1]) + extra_blocks
    num_blocks = sum(blocks_per_seq) + 1  # block 0 stays NaN: masked loads default to it
    cache = torch.full((num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim),
                       float("nan"), dtype=dtype)
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    block_tables = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32)
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        blocks = [order.pop() for _ in range(nb)]
        block_tables[i, :nb] = torch.tensor(blocks, dtype=torch.int32)
        kv = torch.randn(n, 2, num_kv_heads, head_dim, generator=g).to(dtype)
        tok = torch.arange(n)
        cache[torch.tensor(blocks, dtype=torch.long)[tok // block_size], layer, :,
              tok % block_size] = kv
    return cache.to(device)[:, layer], block_tables.to(device)


def as_pool_offsets(scale: torch.Tensor, flags: torch.Tensor,
                    seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense IA3 rows (scale [num_slots, n] float32, flags [num_slots] int32) as paged adapters
    hold them: the flagged rows at shuffled offsets (multiples of 4 floats, gaps between them)
    of a NaN 1-D pool, and [num_slots] int64 offsets, -1 for the slots without a flag."""
    num_slots, n = scale.shape
    stride = -(-(n + 8) // 4) * 4
    order = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))
    pool = torch.full((num_slots * stride + 4,), float("nan"), device=scale.device)
    at = torch.full((num_slots,), -1, dtype=torch.int64)
    for place, slot in enumerate(order.tolist()):
        if flags[slot]:
            at[slot] = place * stride + 4
            pool[at[slot]:at[slot] + n] = scale[slot]
    return pool, at.to(scale.device)

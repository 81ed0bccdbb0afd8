"""What the Triton wrappers share: argument checks that never read device memory (so every
wrapper stays CUDA-graph capturable), launch-config arithmetic, and the few device facts the
configs depend on. No Triton kernel lives here and importing it has no side effects."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

import torch
import triton.language as tl

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)

# Streaming multiprocessors assumed under the interpreter: keeps the grids (and so the CPU
# test time) small while still giving several splits / programs per op.
INTERPRETER_NUM_SMS = 4


def is_interpreting() -> bool:
    """True when Triton runs kernels on the CPU (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    """The least power of 2 at or above n (1 for n <= 1): triton.next_power_of_2's value,
    without its per-call overhead (a constexpr function's argument unwrapping)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (host-side, cached per device; no sync)."""
    if device.type == "cuda":
        return _cuda_sms(torch.cuda.current_device() if device.index is None else device.index)
    return INTERPRETER_NUM_SMS


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def upcast_loads(dtype: torch.dtype) -> bool:
    """Whether a kernel converts its loads to float32 before any arithmetic or `tl.dot`.

    Always under the interpreter (its bf16 arithmetic and bf16 dots are wrong, and fp32
    numpy dots are exact); on the GPU only for float32 inputs, so 16-bit operands reach the
    tensor cores as they are."""
    return is_interpreting() or dtype == torch.float32


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    names = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
    return names[dtype]


def check_launchable(kernel: object, tensors: Iterable[torch.Tensor]) -> torch.device:
    """All tensors on one device, and a device the kernel can run on: CUDA, or the CPU when the
    kernel was defined under `TRITON_INTERPRET=1`. Returns the device."""
    tensors = iter(tensors)
    device = next(tensors).device
    for t in tensors:
        if t.device != device:
            devices = {device, t.device, *(u.device for u in tensors)}
            raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if device.type != "cuda" and type(kernel).__name__ != "InterpretedFunction":
        raise ValueError(
            f"Triton kernels need CUDA tensors, got {device}; to run them on the CPU set "
            "TRITON_INTERPRET=1 before importing loraplex.kernels' Triton modules"
        )
    return device


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...] | None = None,
    shape: tuple[int | None, ...] | None = None,
    contiguous: bool = False,
    unit_last_stride: bool = True,
) -> None:
    """Raise ValueError unless t has ndim dims, one of dtypes, the given sizes (None = any),
    and the layout asked for (fully contiguous, or at least a unit stride on the last dim)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    sizes = t.shape
    if len(sizes) != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(sizes)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be one of ({names}), got {t.dtype}")
    if shape is not None:
        for i, (want, got) in enumerate(zip(shape, sizes)):
            if want is not None and want != got:
                raise ValueError(
                    f"{name} has shape {tuple(sizes)}, expected {want} in dim {i} "
                    f"(expected {tuple('*' if s is None else s for s in shape)})"
                )
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()})")
    if unit_last_stride and ndim > 0 and sizes[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dim (strides {t.stride()})")


def check_kv_layer(kv_layer: torch.Tensor) -> None:
    """kv_layer [num_blocks, 2, block_size, num_kv_heads, head_dim]: the layer view of the
    block-major cache. Its leading (block) stride is free; each block's K and V of this layer
    must be laid out densely."""
    check_tensor("kv_layer", kv_layer, ndim=5, dtypes=FLOAT_DTYPES)
    if kv_layer.shape[1] != 2:
        raise ValueError(f"kv_layer dim 1 must be 2 (K, V), got shape {tuple(kv_layer.shape)}")
    _, _, block_size, num_kv_heads, head_dim = kv_layer.shape
    dense = (block_size * num_kv_heads * head_dim, num_kv_heads * head_dim, head_dim, 1)
    if tuple(kv_layer.stride()[1:]) != dense:
        raise ValueError(
            f"kv_layer must be dense below its block dim: strides {kv_layer.stride()}, "
            f"expected (*, {', '.join(map(str, dense))})"
        )


def check_ia3_vectors(name: str, scale: torch.Tensor, flags_name: str, flags: torch.Tensor,
                      width: int) -> None:
    """IA3's vectors as dense rows (scale [num_slots, width] float32, flags [num_slots] int32) or
    as offsets into the pool (scale 1-D float32, flags [num_slots] int64, -1 for none)."""
    if flags is not None and flags.dtype == torch.int64:
        check_tensor(name, scale, ndim=1, dtypes=(torch.float32,), contiguous=True)
        check_tensor(flags_name, flags, ndim=1, dtypes=(torch.int64,), contiguous=True)
        return
    check_tensor(name, scale, ndim=2, dtypes=(torch.float32,), shape=(None, width))
    check_tensor(flags_name, flags, ndim=1, dtypes=(torch.int32,), shape=(scale.shape[0],), contiguous=True)
    if scale.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dim ({scale.stride()})")

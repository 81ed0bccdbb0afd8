"""One copy from this GPU into another GPU's memory that another process shares with us (CUDA
IPC): a prefill worker's push of prompt blocks into its decode peer's staging area.

torch's copy between two devices also records and waits on events on the target device's
stream, work in this process's context on the peer GPU, which the peer process's kernels share
by time slices. Here the copy is a single cudaMemcpyAsync on this device's current stream,
nothing queued in the peer's context. On two H200s the pushes ran at 33-35 GB/s either way (a
device copy within one process: 392 GB/s), so the cause lies elsewhere, likely in how the IPC
mapping is reached from this GPU: studies/ipc_push_bandwidth.py tries the ways."""

from __future__ import annotations

import ctypes
import functools

import torch

CUDA_MEMCPY_DEFAULT = 4
"""cudaMemcpyDefault: the direction from the pointers (unified addressing)."""
CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704


@functools.cache
def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime that torch loaded in this process (None if none is found)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    return ctypes.CDLL(sorted(paths)[0]) if paths else None


def enable_peer_access(device: torch.device, peer: torch.device) -> bool:
    """Let `device`'s kernels and copies reach `peer`'s memory directly; False where they cannot
    (copies to it then go through torch)."""
    cudart = _cudart()
    if cudart is None or not torch.cuda.can_device_access_peer(device.index, peer.index):
        return False
    with torch.cuda.device(device):
        error = cudart.cudaDeviceEnablePeerAccess(ctypes.c_int(peer.index), ctypes.c_uint(0))
    if error == CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
        cudart.cudaGetLastError()  # (clears it)
        return True
    return error == 0


def copy_to_peer(target: torch.Tensor, source: torch.Tensor, direct: bool) -> None:
    """`target.copy_(source)`, both contiguous, of one dtype and size, `source` on this process's
    GPU and `target` on its peer's: with `direct` (enable_peer_access said so) one
    cudaMemcpyAsync on the source device's current stream, else torch's copy."""
    if not (target.is_contiguous() and source.is_contiguous() and target.dtype == source.dtype
            and target.shape == source.shape):
        raise ValueError("copy_to_peer needs contiguous tensors of one dtype and shape")
    cudart = _cudart()
    if not direct or cudart is None:
        target.copy_(source)
        return
    stream = torch.cuda.current_stream(source.device).cuda_stream
    error = cudart.cudaMemcpyAsync(
        ctypes.c_void_p(target.data_ptr()), ctypes.c_void_p(source.data_ptr()),
        ctypes.c_size_t(source.numel() * source.element_size()), ctypes.c_int(CUDA_MEMCPY_DEFAULT),
        ctypes.c_void_p(stream))
    if error != 0:
        raise RuntimeError(f"cudaMemcpyAsync to the peer GPU failed: CUDA error {error}")

"""The device's own figures, measured at the start of a benchmark run, that its floors are
computed with: memory bandwidth (a large device-to-device copy, read + write) and matrix
throughput (a large square product in the benchmark's dtype). A floor is the time the bytes a
step must move take at that bandwidth, or its FLOPs at that throughput, whichever is longer
(the binding one). Figures measured on one device never judge another: an H200 copies at about
4.3 TB/s where an H100 copies at 3.0, so a 3.0 TB/s floor read 99-115% "of floor" there."""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

COPY_BYTES = {"cuda": 2 << 30, "cpu": 64 << 20}
"""Bytes a timed copy moves each way: far past the caches (the H100's L2 is 50 MB)."""
MATMUL_SIZE = {"cuda": 8192, "cpu": 512}
REPEATS = 10


@dataclass(frozen=True)
class DeviceFloors:
    device: str
    copy_bytes_per_s: float
    """Bytes read + written per second by a device-to-device copy (median of the repeats)."""
    matmul_flops_per_s: float
    """FLOPs per second of a square matrix product in `dtype` (median of the repeats)."""
    dtype: str

    def floor(self, num_bytes: float, flops: float) -> dict[str, Any]:
        """The floor of work that moves `num_bytes` and computes `flops`: both times, and the
        binding one (`floor_s`, `binding`: "bytes" or "flops")."""
        bytes_s, flops_s = num_bytes / self.copy_bytes_per_s, flops / self.matmul_flops_per_s
        return {"bytes_floor_s": bytes_s, "flops_floor_s": flops_s, "floor_s": max(bytes_s, flops_s),
                "binding": "bytes" if bytes_s >= flops_s else "flops"}

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "copy_tb_per_s": round(self.copy_bytes_per_s / 1e12, 3),
                "matmul_tflop_per_s": round(self.matmul_flops_per_s / 1e12, 3)}


@functools.cache
def measure(device: str = "cuda", dtype: str = "bfloat16") -> DeviceFloors:
    """The device's copy bandwidth and matrix throughput (once per process and device)."""
    dev = torch.device(device)
    kind, torch_dtype = dev.type, getattr(torch, dtype)
    copy_s, matmul_s = _copy_seconds(dev, torch_dtype), _matmul_seconds(dev, torch_dtype)
    name = torch.cuda.get_device_name(dev) if kind == "cuda" else "cpu"
    return DeviceFloors(name, 2 * COPY_BYTES[kind] / copy_s, 2 * MATMUL_SIZE[kind] ** 3 / matmul_s, dtype)


def _copy_seconds(device: torch.device, dtype: torch.dtype) -> float:
    element = torch.empty((), dtype=dtype).element_size()
    src = torch.empty(COPY_BYTES[device.type] // element, dtype=dtype, device=device).normal_()
    dst = torch.empty_like(src)
    return _median_time(lambda: dst.copy_(src), device)


def _matmul_seconds(device: torch.device, dtype: torch.dtype) -> float:
    n = MATMUL_SIZE[device.type]
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    return _median_time(lambda: torch.mm(a, b), device)


def _median_time(work: Any, device: torch.device) -> float:
    """Median seconds of `work` over REPEATS runs after two warm-ups (CUDA events on a GPU)."""
    for _ in range(2):
        work()
    times = []
    for _ in range(REPEATS):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            work()
            times.append(time.perf_counter() - started)
    return statistics.median(times)

"""Why does a disaggregated push run at 34 GB/s? Ways to copy 1 GiB from GPU 0, in one process,
into GPU 1 memory that another process allocated and shares, timed each (issue 23; the pushes
of `loraplex bench disaggregated` on two H200s ran at 33-35 GB/s while a device copy within one
process ran at 391-394 GB/s):

  in-process     this process's own tensor on GPU 1, torch's copy (the reference)
  torch          the peer's tensor as torch maps it (CUDA IPC, opened in this process's GPU 1
                 context), torch's copy
  memcpy-early   the same mapping, one cudaMemcpyAsync on GPU 0's stream, peer access from
                 GPU 0 enabled before torch maps it (the workers at 8e8d8fb enabled it after,
                 and their pushes ran at 34 GB/s)
  raw-ipc        the IPC handle opened with GPU 0 current (cudaIpcOpenMemHandle, lazy peer
                 access): the mapping in GPU 0's own context, then one cudaMemcpyAsync (mapped
                 first of all, before peer access is enabled and before torch's mapping)

each with the peer process idle and with it busy with matmuls on GPU 1 (a decode side at work).
Two GPUs (one device call, about a minute):

    OUT=/tmp python studies/ipc_push_bandwidth.py"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor

NUM_BYTES = 1 << 30
ITERATIONS = 10
IPC_LAZY_ENABLE_PEER_ACCESS = 1


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def _libraries() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """The CUDA runtime torch loaded, and the driver."""
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    return ctypes.CDLL(paths[0]), ctypes.CDLL("libcuda.so.1")


def _check(error: int, what: str) -> None:
    if error != 0:
        raise RuntimeError(f"{what}: CUDA error {error}")


def peer(conn, busy) -> None:
    """GPU 1's process: allocate and share the target, then stay (busy with matmuls when asked)."""
    torch.cuda.set_device(1)
    target = torch.zeros(NUM_BYTES, dtype=torch.uint8, device="cuda:1")
    cudart, libcuda = _libraries()
    torch.cuda.synchronize()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(libcuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                           ctypes.c_uint64(target.data_ptr())), "cuMemGetAddressRange")
    handle = IpcHandle()
    _check(cudart.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(base.value)),
           "cudaIpcGetMemHandle")
    conn.send((pickle.dumps(reduce_tensor(target)), bytes(handle.reserved), target.data_ptr() - base.value))
    a = torch.randn(8192, 8192, device="cuda:1", dtype=torch.bfloat16)
    while not conn.poll(0.001):
        if busy.is_set():
            for _ in range(4):
                a @ a
            torch.cuda.synchronize()
    conn.recv()


def _time(copy) -> float:
    copy()
    torch.cuda.synchronize(0)
    started = time.perf_counter()
    for _ in range(ITERATIONS):
        copy()
    torch.cuda.synchronize(0)
    return NUM_BYTES / ((time.perf_counter() - started) / ITERATIONS) / 1e9


def main() -> None:
    out = Path(os.environ.get("OUT", "."))
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    busy = context.Event()
    process = context.Process(target=peer, args=(theirs, busy), daemon=True)
    process.start()
    payload, handle_bytes, offset = ours.recv()
    cudart, _ = _libraries()
    torch.cuda.set_device(0)
    source = torch.randint(0, 255, (NUM_BYTES,), dtype=torch.uint8, device="cuda:0")
    stream = torch.cuda.current_stream(0).cuda_stream

    def memcpy(target_ptr: int):
        def copy():
            _check(cudart.cudaMemcpyAsync(
                ctypes.c_void_p(target_ptr), ctypes.c_void_p(source.data_ptr()), ctypes.c_size_t(NUM_BYTES),
                ctypes.c_int(4), ctypes.c_void_p(stream)), "cudaMemcpyAsync")
        return copy

    result: dict[str, object] = {"device": torch.cuda.get_device_name(0), "bytes": NUM_BYTES,
                                 "can_access_peer": torch.cuda.can_device_access_peer(0, 1)}
    # The raw mapping first (GPU 0's context), then peer access from GPU 0, then torch's mapping
    # (GPU 1's context): each once a process.
    pointer, handle = ctypes.c_void_p(), IpcHandle()
    handle.reserved = handle_bytes
    with torch.cuda.device(0):
        result["raw_open_error"] = cudart.cudaIpcOpenMemHandle(
            ctypes.byref(pointer), handle, ctypes.c_uint(IPC_LAZY_ENABLE_PEER_ACCESS))
        result["enable_peer_access_error"] = cudart.cudaDeviceEnablePeerAccess(ctypes.c_int(1),
                                                                               ctypes.c_uint(0))
    try:
        rebuild, args = pickle.loads(payload)
        mapped = rebuild(*args)
    except Exception as exc:  # noqa: BLE001 (recorded)
        mapped, result["torch_map_error"] = None, repr(exc)
    variants = {"raw-ipc": memcpy(pointer.value + offset) if result["raw_open_error"] == 0 else None,
                "torch": (lambda: mapped.copy_(source)) if mapped is not None else None,
                "memcpy-early": memcpy(mapped.data_ptr()) if mapped is not None else None}
    for state in ("idle", "busy"):
        (busy.set if state == "busy" else busy.clear)()
        time.sleep(0.5)
        own = torch.empty(NUM_BYTES, dtype=torch.uint8, device="cuda:1")
        rows: dict[str, object] = {"in-process": round(_time(lambda own=own: own.copy_(source)), 1)}
        del own
        for name, copy in variants.items():
            try:
                rows[name] = round(_time(copy), 1) if copy is not None else "not mapped"
            except RuntimeError as exc:
                rows[name] = str(exc)
        result[state] = rows
        print(state, rows, flush=True)
    ours.send("stop")
    process.join(10)
    (out / "ipc-push-bandwidth.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()

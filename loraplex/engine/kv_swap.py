"""KV blocks to and from the host pool, for requests preempted by swapping.

The KV cache is block-major (`[num_blocks, layers, 2, block_size, heads, head_dim]`), so one
block is one contiguous run of bytes across all layers, and adjacent block ids are adjacent
runs: each run of adjacent ids on both sides is one copy. On CUDA the host pool is pinned and
the copies run on their own stream:

- swap-outs wait for the steps already queued (the last one that wrote the blocks may still be
  running), and the step launched after them waits for the swap-outs, since it may write the
  blocks they free;
- swap-ins wait for the steps already queued too (the blocks they fill were freed by requests
  those steps may still touch) and run beside the step launched after them; the step after
  that, the first to read them, waits for them.

On CPU the pool is plain memory and the copies run at once.

The device time these waits cost the steps is measured (events on the step stream before and
after each wait): it is the device idle time that swapping causes. On CPU the copies hold up
the step for as long as they take."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

GIB = 1 << 30


@dataclass(frozen=True)
class SwapStats:
    bytes_out: int
    bytes_in: int
    seconds_out: float
    seconds_in: float
    """Time the copies took on the device (their stream's events), or on the host on CPU."""
    seconds_stalled: float = 0.0
    """Time the steps waited for the copies (the device idle time swapping caused)."""


def runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(source, destination, length) runs of `pairs` in which both ids go up one by one."""
    out: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if out and out[-1][0] + out[-1][2] == src and out[-1][1] + out[-1][2] == dst:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((src, dst, 1))
    return out


class KvSwapper:
    def __init__(self, kv_cache: torch.Tensor, num_host_blocks: int) -> None:
        self.kv_cache = kv_cache
        cuda = kv_cache.device.type == "cuda"
        shape = (num_host_blocks, *kv_cache.shape[1:])
        # Plain memory on CPU is only committed where it is written.
        self.host = torch.empty(shape, dtype=kv_cache.dtype, pin_memory=cuda)
        self.block_bytes = kv_cache[0].numel() * kv_cache.element_size()
        self._stream = torch.cuda.Stream(kv_cache.device) if cuda else None
        self._swapped_in: torch.cuda.Event | None = None
        self._timings: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._bytes = {"out": 0, "in": 0}
        self._seconds = {"out": 0.0, "in": 0.0, "stalled": 0.0}

    @staticmethod
    def host_blocks_for(swap_space_gib: float, block_bytes: int) -> int:
        return int(swap_space_gib * GIB) // block_bytes

    def before_step(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Queue a step's swaps, and the waits that keep the step (launched next) and them in
        order."""
        if self._stream is None:
            started = time.perf_counter()
            self._copy("out", swap_out, self.host, self.kv_cache)
            self._copy("in", swap_in, self.kv_cache, self.host)
            self._seconds["stalled"] += time.perf_counter() - started
            return
        self.wait_for_swap_ins()
        main = torch.cuda.current_stream(self.kv_cache.device)
        if not swap_out and not swap_in:
            return
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            self._copy("out", swap_out, self.host, self.kv_cache)
            if swap_out:
                done = torch.cuda.Event()
                done.record()
                self._wait(main, done)
            self._copy("in", swap_in, self.kv_cache, self.host)
            if swap_in:
                self._swapped_in = torch.cuda.Event()
                self._swapped_in.record()

    def wait_for_swap_ins(self) -> None:
        """Make the step stream wait for the previous step's swap-ins (this step reads them)."""
        if self._swapped_in is not None:
            self._wait(torch.cuda.current_stream(self.kv_cache.device), self._swapped_in)
            self._swapped_in = None

    def _wait(self, main: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        """Make the step stream wait for `event`, timing the wait on that stream."""
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(main)
        main.wait_event(event)
        after.record(main)
        self._timings.append(("stalled", before, after))

    def _copy(self, direction: str, pairs: list[tuple[int, int]], dst: torch.Tensor, src: torch.Tensor
              ) -> None:
        if not pairs:
            return
        cuda = self._stream is not None
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            started = time.perf_counter()
        for first_src, first_dst, length in runs(pairs):
            dst[first_dst:first_dst + length].copy_(src[first_src:first_src + length], non_blocking=cuda)
        self._bytes[direction] += len(pairs) * self.block_bytes
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._timings.append((direction, start, end))
        else:
            self._seconds[direction] += time.perf_counter() - started

    def stats(self) -> SwapStats:
        """Bytes copied each way so far, and the time of the copies that have finished."""
        pending = []
        for direction, start, end in self._timings:
            if end.query():
                self._seconds[direction] += start.elapsed_time(end) / 1000
            else:
                pending.append((direction, start, end))
        self._timings = pending
        return SwapStats(self._bytes["out"], self._bytes["in"], self._seconds["out"], self._seconds["in"],
                         self._seconds["stalled"])

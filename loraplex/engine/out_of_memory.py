"""A step that runs out of memory: how the engine tells, and whom it fails.

An allocation can fail in a step although the memory plan sized the KV cache from measured
activations: another process takes device memory, the caching allocator's pool is fragmented,
a step is larger than any measured. The engine then fails one request (the step's largest: the
one whose tokens need the most activations) with DeviceOutOfMemoryError, and the rest of the
step runs again at the next step, as if it had not been launched: the scheduler counts a step's
work only once it is launched (`Scheduler.advance`), and the runner advances its records only
once the model has run (`ModelRunner.dispatch`), so their blocks and rows stay as planned. A
step that keeps running out of memory fails one more request each time, so the engine never
loops on it.

Swaps queued by the failed step may not have run (a swap's copy can fail to allocate too):
requests swapped out by it compute their KV again when they resume, and requests swapped in by
it fail with the largest."""

from __future__ import annotations

import torch

from loraplex.engine.plan import StepPlan
from loraplex.engine.request import Request, RequestStatus
from loraplex.errors import DeviceOutOfMemoryError

CPU_ALLOCATOR_MESSAGE = "can't allocate memory"
"""The CPU allocator's failure raises a plain RuntimeError that says this (errno 12, ENOMEM)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation failed: CUDA's (torch.OutOfMemoryError), the CPU allocator's, or Python's."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and CPU_ALLOCATOR_MESSAGE in str(exc))


def release_cached_memory(device: torch.device) -> None:
    """Give the caching allocator's free blocks back, so that the next step's allocations start
    from an unfragmented pool."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def largest_request(plan: StepPlan, requests: dict[str, Request]) -> str | None:
    """The plan's request with the most tokens in the step (ties: the longest context)."""
    def size(item: tuple[str, int]) -> tuple[int, int]:
        request = requests.get(item[0])
        return item[1], request.num_computed_tokens + item[1] if request is not None else 0

    sizes = list(zip(plan.request_ids, plan.num_scheduled_tokens))
    return max(sizes, key=size)[0] if sizes else None


def swapped_by(plan: StepPlan, requests: dict[str, Request]) -> tuple[list[Request], list[Request]]:
    """(requests the plan swapped out, requests it swapped in)."""
    host_out = {host for _, host in plan.swap_out}
    device_in = {device for _, device in plan.swap_in}
    swapped_out = [r for r in requests.values() if r.status is RequestStatus.WAITING
                   and host_out.intersection(r.host_block_ids)]
    swapped_in = [r for r in requests.values() if r.status is RequestStatus.RUNNING
                  and device_in.intersection(r.block_ids)]
    return swapped_out, swapped_in


def out_of_memory_error(num_tokens: int, exc: BaseException) -> DeviceOutOfMemoryError:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return DeviceOutOfMemoryError(
        f"the engine ran out of device memory computing this request's {num_tokens} tokens in a "
        f"step ({first_line}); the other requests go on. Retry, or send a shorter prompt")

"""What a worker sends back to the driver, one reply per command."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from loraplex.engine.kv_swap import SwapStats
from loraplex.engine.plan import StepResult


@dataclass
class RunnerCounters:
    """Rank 0's runner statistics so far (the engine's stats read them)."""

    num_relay_steps: int = 0
    num_relay_groups: int = 0
    num_relay_members: int = 0
    swap: SwapStats | None = None
    """KV copied to and from rank 0's host pool (None: it has none)."""


@dataclass
class StepOutput:
    """Rank 0's answer to a RunStep."""

    result: StepResult
    logits: torch.Tensor | None = None
    """[num_samples, vocab] float32, when asked for."""
    counters: RunnerCounters | None = None


@dataclass(frozen=True)
class MemoryReport:
    """A rank's answer to MeasureMemory (CUDA): bytes, as the single-process engine plans them."""

    budget_bytes: int
    """Left for the rank's pool of KV blocks and adapter slots."""
    activation_bytes: int
    graph_bytes: int


@dataclass(frozen=True)
class KvHandle:
    """A worker's KV cache as another process on the machine maps it (ShareKv's reply)."""

    device: str
    """"cuda" (`cuda_ipc`: CUDA IPC, pickled) or "cpu" (`path`: a file under /dev/shm)."""
    shape: tuple[int, ...]
    dtype: str
    cuda_ipc: bytes = b""
    path: str = ""


@dataclass(frozen=True)
class KvReceived:
    """A ReceiveKv's answer."""

    num_bytes: int
    seconds: float
    """From the first copy queued to the last one done (the device synchronized)."""


@dataclass
class Done:
    rank: int
    value: Any = None
    """The command's answer (rank 0's StepOutput, LoadModel's shapes), None for acks."""


@dataclass
class Failed:
    rank: int
    error: str
    """The worker's traceback."""


Reply = Done | Failed

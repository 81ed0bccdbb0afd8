"""What a worker sends back to the driver, one reply per command."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from loraplex.engine.plan import StepResult


@dataclass
class StepOutput:
    """Rank 0's answer to a RunStep."""

    result: StepResult
    logits: torch.Tensor | None = None
    """[num_samples, vocab] float32, when asked for."""


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

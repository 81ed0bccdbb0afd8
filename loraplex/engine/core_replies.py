"""What the engine-core process sends the server process, in order on one pipe."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from loraplex.engine.cuda_graphs import CaptureReport
from loraplex.engine.sizing import MemoryPlan
from loraplex.engine_config import EngineConfig
from loraplex.model.model_config import ModelConfig
from loraplex.types import RequestOutput, StreamingWindow


@dataclass(frozen=True)
class EngineFacts:
    """The built engine's fixed facts, which the server reads without asking the core."""

    config: EngineConfig
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    streaming_window: StreamingWindow | None
    memory: MemoryPlan
    graphs: CaptureReport | None
    eos_token_ids: frozenset[int]
    pid: int
    """The engine-core process's id."""


@dataclass(frozen=True)
class Ready:
    """The engine is built; sent once, first."""

    facts: EngineFacts


@dataclass(frozen=True)
class CallDone:
    call_id: int
    value: Any = None


@dataclass(frozen=True)
class CallFailed:
    """A command failed: `error` is the exception itself where it pickles (a LoraplexError keeps
    its code and param, so the API answers as it would in one process), else a RuntimeError
    carrying `traceback`."""

    call_id: int | None
    """None: the engine could not be built (the answer to the start)."""
    error: BaseException
    traceback: str


@dataclass(frozen=True)
class StepOutputs:
    """One step's outputs, all in one message. Each output's `prompt_token_ids` is left empty;
    where the step's output extends what was sent before (`is_delta`), its `token_ids` is empty
    (the step's tokens are its `new_token_ids`), its `text` and `logprobs` hold only what the step
    added, and its `prompt_logprobs` is None after the first output: the server puts them back
    from what it keeps of the request."""

    outputs: list[RequestOutput]
    is_delta: list[bool]


@dataclass(frozen=True)
class AdapterWanted:
    """The engine's adapter cache needs the adapter of `digest` (answered with
    core_commands.AdapterLoaded)."""

    load_id: int
    digest: str


@dataclass(frozen=True)
class CoreDied:
    """The step loop failed; the process exits after sending this."""

    traceback: str

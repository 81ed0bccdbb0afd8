"""Steps timed by themselves on the device (LLMEngine.time_steps), for the benchmarks: with async
scheduling a step's wall time is mostly the device time of the step collected in it, the one
before, so figures by what a step planned need each step's own time."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.plan import StepPlan


@dataclass(frozen=True)
class TimedStep:
    """A step as planned, and its own time on the device."""

    prompt_tokens: int
    requests: int
    swap_in_blocks: int
    swap_out_blocks: int
    device_s: float

    @classmethod
    def of(cls, plan: StepPlan, device_s: float) -> TimedStep:
        return cls(plan.num_tokens - sum(plan.samples), len(plan.request_ids), len(plan.swap_in),
                   len(plan.swap_out), device_s)


DEVICE_LOG_HEADER = "collected_s,device_ms,prompt_tokens,requests,swap_in_blocks,swap_out_blocks\n"


def log_device_steps(engine: LLMEngine, path: Path) -> TextIO:
    """Write a CSV line for every step `engine` collects: when (Unix time), its own device time,
    and what it planned. Returns the file (line-buffered), for the caller to close."""
    out = path.open("w", buffering=1)
    out.write(DEVICE_LOG_HEADER)

    def write(plan: StepPlan, device_s: float) -> None:
        step = TimedStep.of(plan, device_s)
        out.write(f"{time.time():.4f},{1e3 * step.device_s:.3f},{step.prompt_tokens},{step.requests},"
                  f"{step.swap_in_blocks},{step.swap_out_blocks}\n")

    engine.time_steps(write)
    return out

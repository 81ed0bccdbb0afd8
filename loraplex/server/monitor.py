"""Engine state, sampled on the engine thread every few seconds (and on demand) for /metrics,
/ready and the admin API: requests running and waiting, KV blocks, resident adapters, and the
generation rate in tokens per second."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, replace

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSnapshot:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    num_generated_tokens: int
    num_prompt_tokens: int
    resident_adapters: tuple[str, ...]
    """Digests of the adapters in device slots."""
    num_adapter_slots: int
    host_adapters: tuple[str, ...]
    """Digests of the adapters the engine holds in host memory."""
    sampled_at: float
    tokens_per_second: float = 0.0

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


def _sample(engine: LLMEngine) -> EngineSnapshot:
    """Runs on the engine thread."""
    stats = engine.stats()
    return EngineSnapshot(
        num_running=int(stats["num_running"]), num_waiting=int(stats["num_waiting"]),
        num_swapped=int(stats["num_swapped"]), kv_blocks_used=int(stats["kv_blocks_used"]),
        kv_blocks_total=int(stats["kv_blocks_total"]), num_preemptions=int(stats["num_preemptions"]),
        num_generated_tokens=int(stats["num_generated_tokens"]),
        num_prompt_tokens=int(stats["num_prompt_tokens"]),
        resident_adapters=tuple(engine.slots.resident), num_adapter_slots=engine.slots.num_slots,
        host_adapters=tuple(sorted(set(engine.adapters.names.values()))),
        sampled_at=time.monotonic(),
    )


class EngineMonitor:
    def __init__(self, engine: AsyncEngine, interval_s: float) -> None:
        self._engine = engine
        self._interval_s = interval_s
        self.latest: EngineSnapshot | None = None
        self._rate_base: EngineSnapshot | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def refresh(self) -> EngineSnapshot:
        """Sample now and keep it as `latest`. The rate is measured over at least one polling
        interval, so frequent scrapes do not make it noisy."""
        snapshot = await self._engine.call(_sample)
        base = self._rate_base
        rate = self.latest.tokens_per_second if self.latest is not None else 0.0
        if base is None:
            self._rate_base = snapshot
        elif snapshot.sampled_at - base.sampled_at >= self._interval_s:
            rate = (snapshot.num_generated_tokens - base.num_generated_tokens) / (
                snapshot.sampled_at - base.sampled_at)
            self._rate_base = snapshot
        self.latest = replace(snapshot, tokens_per_second=rate)
        return self.latest

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # a dead engine: /ready reports it
                logger.debug("engine sample failed", exc_info=True)
            await asyncio.sleep(self._interval_s)

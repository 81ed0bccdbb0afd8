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
from loraplex.engine.core_client import EngineCoreClient
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.stats import EngineStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSnapshot:
    stats: EngineStats
    sampled_at: float
    """time.monotonic() when it was taken."""
    sampled_wall: float
    """time.time() when it was taken."""
    tokens_per_second: float = 0.0


def _sample(engine: LLMEngine) -> EngineSnapshot:
    """Runs on the engine thread."""
    return EngineSnapshot(engine.stats(), time.monotonic(), time.time())


class EngineMonitor:
    def __init__(self, engine: AsyncEngine | EngineCoreClient, interval_s: float) -> None:
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
            rate = (snapshot.stats.num_generated_tokens - base.stats.num_generated_tokens) / (
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

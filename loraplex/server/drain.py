"""Drain on SIGTERM: uvicorn's server, told to stop, first stops admitting. Readiness fails
(`/ready` answers 503, so a load balancer or the Gateway's endpoint picker stops sending work)
and new generation requests get 503 with Retry-After, while requests already admitted run to
their end; once none is left, or the drain timeout has passed, the server shuts down as uvicorn
does (connections closed, the lifespan's shutdown) and the process exits 0. A second SIGTERM, or
SIGINT, stops at once as plain uvicorn does. Liveness (`/health`) answers 200 throughout."""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType
from typing import Any

import uvicorn

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.drain_timeout_s = drain_timeout_s
        self.drain_started: float | None = None
        """time.monotonic() when SIGTERM came; None while serving."""

    def _services(self) -> Any:
        state = getattr(self.config.app, "state", None)
        return getattr(state, "services", None)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as the signal handler, on the event loop's thread: set flags only.
        if sig == signal.SIGTERM and self.drain_started is None and self.started:
            self.drain_started = time.monotonic()
            services = self._services()
            if services is not None:
                services.begin_drain()
            return  # not recorded for uvicorn to raise again after shutdown: a drain exits 0
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_started is not None and not self.should_exit:
            services = self._services()
            in_flight = 0 if services is None else services.limiter.num_in_flight
            waited = time.monotonic() - self.drain_started
            if counter % 10 == 0:
                logger.info("draining: %d requests in flight after %.1f s", in_flight, waited)
            if in_flight == 0 or waited >= self.drain_timeout_s:
                if in_flight:
                    logger.warning("drain timeout (%.0f s): stopping with %d requests in flight",
                                   self.drain_timeout_s, in_flight)
                else:
                    logger.info("drained in %.1f s: shutting down", waited)
                self.should_exit = True
        return await super().on_tick(counter)

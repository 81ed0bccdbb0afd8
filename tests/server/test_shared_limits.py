"""Two limiters (two replicas' worth) sharing one registry's rate windows, on clocks the test
moves: each one's admissions count against the tenant on the other after an exchange, for
requests per minute, tokens per minute (a returned reservation included) and requests in flight;
the window still slides; Retry-After waits for the other replica's oldest charge."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from loraplex.registry import Registry, RegistryConfig
from loraplex.registry.records import TenantRecord
from loraplex.server.http_errors import RateLimitError
from loraplex.server.limits import WINDOW_S, Limiter
from loraplex.server.shared_limits import SharedLimits


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def registry(registry_config: RegistryConfig) -> Iterator[Registry]:
    with Registry.open(registry_config) as opened:
        yield opened


def _replicas(registry: Registry, clock: Clock) -> tuple[Limiter, Limiter]:
    return tuple(Limiter(100, 1, clock=clock, shared=SharedLimits(
        registry.rate_windows.exchange, 0.25, WINDOW_S, replica=name, clock=clock, wall_clock=clock))
        for name in "ab")


def _sync(*limiters: Limiter) -> None:
    async def exchange() -> None:
        for _ in range(2):  # each one sends, then each one reads the others'
            for limiter in limiters:
                await limiter.shared.exchange()
    asyncio.run(exchange())


def _tenant(registry: Registry, **limits: int) -> TenantRecord:
    return registry.tenants.create("acme", **limits)


def test_requests_per_minute_add_up_across_replicas(registry: Registry) -> None:
    clock = Clock()
    a, b = _replicas(registry, clock)
    tenant = _tenant(registry, max_requests_per_minute=3)
    for _ in range(2):
        a.admit(tenant).release()
    b.admit(tenant).release()  # b has not heard of a's two yet
    _sync(a, b)
    for limiter in (a, b):
        with pytest.raises(RateLimitError) as caught:
            limiter.admit(tenant)
        assert caught.value.headers["x-ratelimit-remaining-requests"] == "0"
        assert 59 <= int(caught.value.headers["Retry-After"]) <= 61
    clock.now += WINDOW_S + 1
    _sync(a, b)
    b.admit(tenant).release()


def test_tokens_per_minute_add_up_and_returned_tokens_count(registry: Registry) -> None:
    clock = Clock()
    a, b = _replicas(registry, clock)
    tenant = _tenant(registry, max_tokens_per_minute=100)
    admission = a.admit(tenant)
    admission.reserve(70)
    _sync(a, b)
    with pytest.raises(RateLimitError):
        b.admit(tenant).reserve(40)
    admission.release(20)  # it used 20 of its 70
    _sync(a, b)
    held = b.admit(tenant)
    held.reserve(80)
    _sync(a, b)
    with pytest.raises(RateLimitError):
        a.admit(tenant).reserve(1)


def test_requests_in_flight_add_up_and_a_silent_replica_stops_counting(registry: Registry) -> None:
    clock = Clock()
    a, b = _replicas(registry, clock)
    tenant = _tenant(registry, max_concurrent_requests=2)
    a.admit(tenant)
    on_b = b.admit(tenant)
    _sync(a, b)
    with pytest.raises(RateLimitError, match="2 requests in flight"):
        b.admit(tenant)
    on_b.release()
    _sync(a, b)
    b.admit(tenant)
    assert b.shared.remote_in_flight(tenant.id) == 1
    clock.now += 30  # a stops exchanging: past the stale bound b no longer counts a's request
    _sync(b)
    assert b.shared.remote_in_flight(tenant.id) == 0
    b.admit(tenant)

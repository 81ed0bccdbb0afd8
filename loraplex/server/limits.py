"""Admission control: a bound on requests in flight across the server (503 past it) and each
tenant's limits from the registry (429 past them): concurrent requests, requests per minute
and tokens per minute over a sliding 60-second window. A request is admitted as soon as its
key is known, before any work is done for it (so refusals count too); it reserves its prompt
plus `max_tokens` against the token window before it is generated and is charged what it
really used when it ends. This replica's counts are exact; with `shared`
(loraplex.server.shared_limits: replicas on one PostgreSQL registry) the other replicas' counts,
as of the last exchange, are added to them. State is touched only from the event loop."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplex.registry.records import TenantRecord
from loraplex.server.http_errors import RateLimitError, ServiceUnavailableError
from loraplex.server.shared_limits import SharedLimits

WINDOW_S = 60.0


@dataclass
class _Charge:
    at: float
    tokens: int
    slot: int = 0
    """The shared slot it is counted in (with SharedLimits)."""
    is_shared: bool = False


@dataclass
class _TenantWindow:
    in_flight: int = 0
    charges: deque[_Charge] = field(default_factory=deque)

    def expire(self, now: float) -> None:
        while self.charges and self.charges[0].at <= now - WINDOW_S:
            self.charges.popleft()


@dataclass
class Admission:
    """A request let in: it counts against the server's and its tenant's limits from `admit`
    until `release`, whatever becomes of it (a request refused later as invalid still took a
    slot and a request of the minute). `reserve` its tokens before generating; `release` it
    exactly once, with the tokens it used."""

    limiter: Limiter
    tenant: TenantRecord
    charge: _Charge
    is_released: bool = False

    def reserve(self, num_tokens: int) -> None:
        """Reserve prompt + max_tokens against the tenant's tokens per minute, or raise
        RateLimitError (the request still counts as one)."""
        self.limiter._reserve(self, num_tokens)

    def release(self, num_tokens: int | None = None) -> None:
        """End the request; `num_tokens` is what it used (None: what it reserved, or nothing)."""
        if self.is_released:
            return
        self.is_released = True
        if num_tokens is not None:
            self.limiter._set_tokens(self, num_tokens)
        self.limiter._release(self.tenant)


class Limiter:
    def __init__(self, max_in_flight: int, retry_after_s: int,
                 clock: Callable[[], float] = time.monotonic, shared: SharedLimits | None = None) -> None:
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.num_in_flight = 0
        self.shared = shared
        self._clock = clock
        self._tenants: dict[str, _TenantWindow] = {}

    def admit(self, tenant: TenantRecord) -> Admission:
        """Let a request in, or raise ServiceUnavailableError (server full) / RateLimitError
        (the tenant is at its concurrent requests or its requests per minute)."""
        if self.num_in_flight >= self.max_in_flight:
            raise ServiceUnavailableError(
                f"the server is at its limit of {self.max_in_flight} requests in flight; retry "
                f"shortly", retry_after_s=self.retry_after_s, code="server_overloaded")
        now = self._clock()
        window = self._tenants.setdefault(tenant.name, _TenantWindow())
        window.expire(now)
        load = self._load(tenant, window, now)
        self._check_requests(tenant, load)
        charge = _Charge(now, 0)
        if tenant.max_requests_per_minute is not None or tenant.max_tokens_per_minute is not None:
            window.charges.append(charge)
            if self.shared is not None:
                charge.slot, charge.is_shared = self.shared.slot(), True
                self.shared.add(tenant.id, charge.slot, 1, 0)
        window.in_flight += 1
        self.num_in_flight += 1
        if self.shared is not None:
            self.shared.set_in_flight(tenant.id, window.in_flight)
        return Admission(self, tenant, charge)

    def _load(self, tenant: TenantRecord, window: _TenantWindow, now: float) -> _Load:
        charges = [(c.at, 1, c.tokens) for c in window.charges]
        in_flight = window.in_flight
        if self.shared is not None:
            remote = self.shared.remote_charges(tenant.id, now, WINDOW_S)
            charges = sorted(charges + [(c.at, c.num_requests, c.num_tokens) for c in remote])
            in_flight += self.shared.remote_in_flight(tenant.id)
        return _Load(now, in_flight, charges, _headers(tenant, charges))

    def _check_requests(self, tenant: TenantRecord, load: _Load) -> None:
        limit = tenant.max_concurrent_requests
        if limit is not None and load.in_flight >= limit:
            raise RateLimitError(
                f"tenant {tenant.name!r} has {load.in_flight} requests in flight, its limit is "
                f"{limit}", headers=load.headers | {"Retry-After": "1"})
        limit = tenant.max_requests_per_minute
        if limit is not None and load.num_requests >= limit:
            raise RateLimitError(f"tenant {tenant.name!r} is over its limit of {limit} requests per "
                                 f"minute", headers=load.headers | _retry_after(load.wait_s(1, 1, limit)))

    def _reserve(self, admission: Admission, num_tokens: int) -> None:
        tenant, limit = admission.tenant, admission.tenant.max_tokens_per_minute
        if limit is None:
            self._set_tokens(admission, num_tokens)
            return
        now = self._clock()
        window = self._tenants[tenant.name]
        window.expire(now)
        load = self._load(tenant, window, now)
        if num_tokens > limit:
            raise RateLimitError(
                f"this request may use {num_tokens} tokens (prompt + max_tokens), more than tenant "
                f"{tenant.name!r}'s limit of {limit} tokens per minute; lower max_tokens",
                headers=load.headers, can_retry=False)
        if load.num_tokens + num_tokens > limit:
            wait = load.wait_s(2, num_tokens, limit)
            raise RateLimitError(f"tenant {tenant.name!r} is over its limit of {limit} tokens per "
                                 f"minute", headers=load.headers | _retry_after(wait))
        self._set_tokens(admission, num_tokens)

    def _set_tokens(self, admission: Admission, num_tokens: int) -> None:
        charge = admission.charge
        if charge.is_shared and self.shared is not None and num_tokens != charge.tokens:
            self.shared.add(admission.tenant.id, charge.slot, 0, num_tokens - charge.tokens)
        charge.tokens = num_tokens

    def _release(self, tenant: TenantRecord) -> None:
        self.num_in_flight -= 1
        window = self._tenants[tenant.name]
        window.in_flight -= 1
        if self.shared is not None:
            self.shared.set_in_flight(tenant.id, window.in_flight)
        if window.in_flight == 0 and not window.charges:
            del self._tenants[tenant.name]

    def in_flight(self, tenant: str) -> int:
        window = self._tenants.get(tenant)
        return 0 if window is None else window.in_flight


def _retry_after(wait_s: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(wait_s)))}


@dataclass(frozen=True)
class _Load:
    """A tenant's load at `now`: requests in flight and the window's charges, oldest first, as
    (time, requests, tokens)."""

    now: float
    in_flight: int
    charges: list[tuple[float, int, int]]
    headers: dict[str, str]

    @property
    def num_requests(self) -> int:
        return sum(c[1] for c in self.charges)

    @property
    def num_tokens(self) -> int:
        return sum(c[2] for c in self.charges)

    def wait_s(self, column: int, amount: int, limit: int) -> float:
        """Seconds until `amount` more of requests (column 1) or tokens (2) fit under `limit`,
        as the oldest charges expire."""
        left = sum(c[column] for c in self.charges)
        for charge in self.charges:
            left -= charge[column]
            if left + amount <= limit:
                return charge[0] + WINDOW_S - self.now
        return WINDOW_S


def _headers(tenant: TenantRecord, charges: list[tuple[float, int, int]]) -> dict[str, str]:
    headers = {}
    if tenant.max_requests_per_minute is not None:
        headers["x-ratelimit-limit-requests"] = str(tenant.max_requests_per_minute)
        headers["x-ratelimit-remaining-requests"] = str(
            max(0, tenant.max_requests_per_minute - sum(c[1] for c in charges)))
    if tenant.max_tokens_per_minute is not None:
        headers["x-ratelimit-limit-tokens"] = str(tenant.max_tokens_per_minute)
        headers["x-ratelimit-remaining-tokens"] = str(
            max(0, tenant.max_tokens_per_minute - sum(c[2] for c in charges)))
    return headers

"""Admission control: a bound on requests in flight across the server (503 past it) and each
tenant's limits from the registry (429 past them): concurrent requests, requests per minute
and tokens per minute over a sliding 60-second window. A request is admitted as soon as its
key is known, before any work is done for it (so refusals count too); it reserves its prompt
plus `max_tokens` against the token window before it is generated and is charged what it
really used when it ends. State lives in this process (one replica); it is touched only from
the event loop."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplex.registry.records import TenantRecord
from loraplex.server.http_errors import RateLimitError, ServiceUnavailableError

WINDOW_S = 60.0


@dataclass
class _Charge:
    at: float
    tokens: int


@dataclass
class _TenantWindow:
    in_flight: int = 0
    charges: deque[_Charge] = field(default_factory=deque)

    def expire(self, now: float) -> None:
        while self.charges and self.charges[0].at <= now - WINDOW_S:
            self.charges.popleft()

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.charges)


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
            self.charge.tokens = num_tokens
        self.limiter._release(self.tenant.name)


class Limiter:
    def __init__(self, max_in_flight: int, retry_after_s: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.num_in_flight = 0
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
        self._check_requests(tenant, window, now)
        charge = _Charge(now, 0)
        if tenant.max_requests_per_minute is not None or tenant.max_tokens_per_minute is not None:
            window.charges.append(charge)
        window.in_flight += 1
        self.num_in_flight += 1
        return Admission(self, tenant, charge)

    def _check_requests(self, tenant: TenantRecord, window: _TenantWindow, now: float) -> None:
        headers = _headers(tenant, window)
        limit = tenant.max_concurrent_requests
        if limit is not None and window.in_flight >= limit:
            raise RateLimitError(
                f"tenant {tenant.name!r} has {window.in_flight} requests in flight, its limit is "
                f"{limit}", headers=headers | {"Retry-After": "1"})
        limit = tenant.max_requests_per_minute
        if limit is not None and len(window.charges) >= limit:
            wait = window.charges[-limit].at + WINDOW_S - now
            raise RateLimitError(f"tenant {tenant.name!r} is over its limit of {limit} requests per "
                                 f"minute", headers=headers | _retry_after(wait))

    def _reserve(self, admission: Admission, num_tokens: int) -> None:
        tenant, limit = admission.tenant, admission.tenant.max_tokens_per_minute
        if limit is None:
            admission.charge.tokens = num_tokens
            return
        now = self._clock()
        window = self._tenants[tenant.name]
        window.expire(now)
        headers = _headers(tenant, window)
        if num_tokens > limit:
            raise RateLimitError(
                f"this request may use {num_tokens} tokens (prompt + max_tokens), more than tenant "
                f"{tenant.name!r}'s limit of {limit} tokens per minute; lower max_tokens",
                headers=headers, can_retry=False)
        used = window.tokens
        if used + num_tokens > limit:
            freed, wait = 0, WINDOW_S
            for charge in window.charges:  # oldest first: wait until enough has expired
                freed += charge.tokens
                if used - freed + num_tokens <= limit:
                    wait = charge.at + WINDOW_S - now
                    break
            raise RateLimitError(f"tenant {tenant.name!r} is over its limit of {limit} tokens per "
                                 f"minute", headers=headers | _retry_after(wait))
        admission.charge.tokens = num_tokens

    def _release(self, tenant: str) -> None:
        self.num_in_flight -= 1
        window = self._tenants[tenant]
        window.in_flight -= 1
        if window.in_flight == 0 and not window.charges:
            del self._tenants[tenant]

    def in_flight(self, tenant: str) -> int:
        window = self._tenants.get(tenant)
        return 0 if window is None else window.in_flight


def _retry_after(wait_s: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(wait_s)))}


def _headers(tenant: TenantRecord, window: _TenantWindow) -> dict[str, str]:
    headers = {}
    if tenant.max_requests_per_minute is not None:
        headers["x-ratelimit-limit-requests"] = str(tenant.max_requests_per_minute)
        headers["x-ratelimit-remaining-requests"] = str(
            max(0, tenant.max_requests_per_minute - len(window.charges)))
    if tenant.max_tokens_per_minute is not None:
        headers["x-ratelimit-limit-tokens"] = str(tenant.max_tokens_per_minute)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, tenant.max_tokens_per_minute - window.tokens))
    return headers

"""Scheduling policies: the order in which waiting requests are admitted and which running
request is preempted when the KV cache runs short. The scheduler asks its policy for both and
decides nothing of the kind itself. Pure Python.

A policy owns the waiting queue (a request waits when it arrives and again after it is
preempted), so it can keep whatever structure its order needs."""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterator, Sequence

from loraplex.engine.request import Request
from loraplex.engine.tenants import TenantTable


class SchedulingPolicy(ABC):
    def __init__(self, tenants: TenantTable) -> None:
        self.tenants = tenants

    @abstractmethod
    def add(self, request: Request) -> None:
        """`request` starts waiting: it arrived, or it was preempted."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """`request` stops waiting: it was admitted, aborted or failed."""

    @abstractmethod
    def waiting(self) -> Iterator[Request]:
        """The waiting requests in the order they should be admitted. The scheduler may stop
        early, and may skip a request that cannot run yet (its adapter is loading)."""

    @abstractmethod
    def choose_victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt when the KV cache runs short (`running` is never
        empty)."""

    @property
    @abstractmethod
    def num_waiting(self) -> int: ...

    def charge(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        """A step computed `prompt_tokens` of `request`'s prompt for the first time and sampled
        `output_tokens` for it (the service its tenant received)."""
        return None  # a policy that counts no service ignores it

    def started(self, request: Request) -> None:
        """`request` was admitted and runs."""
        return None

    def stopped(self, request: Request) -> None:
        """`request` stopped running: finished, aborted, failed or preempted."""
        return None

    def fairness_victim(self, running: Sequence[Request], blocked: Request) -> Request | None:
        """A running request to preempt so that `blocked` (waiting, first in the policy's order,
        and kept out by a lack of running places, KV blocks or a device slot: then `running`
        holds only requests whose preemption frees a slot) can run; None to let it wait."""
        return None

    def holds_back(self, request: Request, max_places: int, loading: set[str]) -> bool:
        """Whether `request` leaves a free running place (of `max_places`) to others for now,
        while requests of the tenants in `loading` wait for their adapters."""
        return False

    def leaves_headroom(self, request: Request) -> bool:
        """Whether waiting `request` starts only while the KV blocks left free after it are at
        least SchedulerConfig.fairness_kv_headroom of the cache (kept for other tenants)."""
        return False

    def prefills_first(self, request: Request) -> bool:
        """Whether the rest of running `request`'s prompt takes the step's token budget before
        waiting requests are admitted (True), or only what they leave (False)."""
        return True

    def order_prefills(self, prompts: list[Request]) -> list[Request]:
        """The running requests still computing their prompts (in running order), in the order
        in which their chunks take the step's token budget."""
        return prompts

    def capped_tenants(self, decoding: Sequence[Request]) -> set[str]:
        """Tenants whose prompt chunks share a smaller per-step budget this step
        (SchedulerConfig.max_capped_prefill_tokens), given the requests that decode in it."""
        return set()

    def counters(self) -> dict[str, float]:
        """Each tenant's service as the policy counts it (empty if it counts none)."""
        return {}


class FcfsPolicy(SchedulingPolicy):
    """First come, first served: admission by arrival (a preempted request keeps its place, so
    it resumes before anything that arrived after it); the newest running request is preempted
    first, so the oldest keep their progress. Tenants and weights play no part."""

    def __init__(self, tenants: TenantTable) -> None:
        super().__init__(tenants)
        self._queue: list[Request] = []  # ordered by arrival

    def add(self, request: Request) -> None:
        bisect.insort(self._queue, request, key=_arrival)

    def remove(self, request: Request) -> None:
        index = bisect.bisect_left(self._queue, request.arrival, key=_arrival)
        if index < len(self._queue) and self._queue[index] is request:
            del self._queue[index]

    def waiting(self) -> Iterator[Request]:
        return iter(list(self._queue))

    def choose_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=_arrival)

    @property
    def num_waiting(self) -> int:
        return len(self._queue)


def _arrival(request: Request) -> int:
    return request.arrival


PROMPT_PRICE, OUTPUT_PRICE = 1.0, 2.0
"""Service of one prompt token computed and of one token generated (VTC's prices)."""


class VtcPolicy(SchedulingPolicy):
    """Virtual token counters (Sheng et al., "Fairness in Serving Large Language Models", OSDI
    2024), weighted and preemptive.

    Each tenant's counter is its service, prompt tokens computed + 2 x tokens generated, each
    divided by the tenant's weight at the time. Admission takes the backlogged tenant with the
    lowest counter, its requests first come, first served; a tenant that becomes active (a
    request arrives while it has nothing waiting or running) is lifted to the lowest counter
    among the active tenants, so idle time is not banked. Victims come from the running tenant
    with the highest counter, its request with the least work done first; and when a backlogged
    tenant's counter falls more than `bound` behind that tenant's, one of its requests is
    preempted although nothing ran short.

    The bound: with every tenant backlogged, VTC keeps the service of any two within 2U of
    each other, U = max(prompt price x longest prompt, output price x most tokens in the running
    batch) (the paper's Theorem 4.4, for a scheduler that does not preempt); preempting at a gap
    of `bound` tightens that to about bound + the service of one step."""

    def __init__(self, tenants: TenantTable, bound: float) -> None:
        super().__init__(tenants)
        self.bound = bound
        self._queues: dict[str, list[Request]] = {}  # backlogged tenants' requests, by arrival
        self._counters: dict[str, float] = {}
        self._running: Counter[str] = Counter()

    def add(self, request: Request) -> None:
        tenant = request.tenant
        queue = self._queues.get(tenant)
        if queue is None:
            if not self._running[tenant]:  # becomes active: lift to the lowest active counter
                active = [self._counters[t] for t in self._active() if t != tenant]
                own = self._counters.get(tenant, 0.0)
                self._counters[tenant] = max([own, min(active)] if active else [own])
            queue = self._queues[tenant] = []
        bisect.insort(queue, request, key=_arrival)

    def remove(self, request: Request) -> None:
        queue = self._queues.get(request.tenant)
        if queue is None:
            return
        index = bisect.bisect_left(queue, request.arrival, key=_arrival)
        if index < len(queue) and queue[index] is request:
            del queue[index]
        if not queue:
            del self._queues[request.tenant]

    def waiting(self) -> Iterator[Request]:
        """The lowest counter first, counting what each request admitted before it will cost
        (its prompt), so that one step admits across tenants as the counters will stand."""
        queues = {tenant: list(queue) for tenant, queue in self._queues.items()}
        projected = {tenant: self._counters[tenant] for tenant in queues}
        heads = dict.fromkeys(queues, 0)
        while projected:
            tenant = min(projected, key=lambda t: (projected[t], queues[t][heads[t]].arrival))
            request = queues[tenant][heads[tenant]]
            heads[tenant] += 1
            if heads[tenant] == len(queues[tenant]):
                del projected[tenant]
            else:
                prompt = max(0, request.num_prompt_tokens - request.num_prompt_charged)
                projected[tenant] += (PROMPT_PRICE * prompt + OUTPUT_PRICE) / self.tenants.weight(tenant)
            yield request

    def choose_victim(self, running: Sequence[Request]) -> Request:
        most_served = max({r.tenant for r in running}, key=lambda t: self._counters.get(t, 0.0))
        return min((r for r in running if r.tenant == most_served),
                   key=lambda r: (r.num_computed_tokens, -r.arrival))

    def fairness_victim(self, running: Sequence[Request], blocked: Request) -> Request | None:
        victim = self.choose_victim(running)
        gap = self._counters.get(victim.tenant, 0.0) - self._counters.get(blocked.tenant, 0.0)
        return victim if gap > self.bound else None

    def holds_back(self, request: Request, max_places: int, loading: set[str]) -> bool:
        """A tenant that holds its weighted share of the running places takes no more while
        another tenant's requests wait for their adapters: it would lose them again one
        fairness preemption at a time as those adapters arrive (issue 27: a batch of 600
        requests over 40 tenants sent at once)."""
        if not loading - {request.tenant}:
            return False
        active = self._active() | {request.tenant}
        total = sum(self.tenants.weight(t) for t in active)
        share = max_places * self.tenants.weight(request.tenant) / total
        return self._running[request.tenant] >= max(1, int(share))

    def capped_tenants(self, decoding: Sequence[Request]) -> set[str]:
        """The active tenants served more than a tenant that decodes in this step: their prompt
        chunks would lengthen the step, and so the time between tokens, of a tenant behind them
        in service."""
        active = self._active()
        if len(active) < 2:  # one tenant (the usual case) caps nobody: skip the decode rows
            return set()
        decoders = {r.tenant for r in decoding}
        if not decoders:
            return set()
        least = min(self._counters.get(t, 0.0) for t in decoders)
        return {t for t in active if self._counters.get(t, 0.0) > least + self.bound}

    def leaves_headroom(self, request: Request) -> bool:
        """Its tenant is the most served of the active tenants and more than `bound` ahead of the
        least served one: the tenants behind it then start their requests in the blocks it
        leaves, instead of swapping its requests out one fairness preemption at a time. Only
        the most served: tenants that are not backlogged drift apart by more than the bound, and
        a rule for any tenant ahead held light tenants back behind each other."""
        own = self._counters.get(request.tenant, 0.0)
        others = [self._counters.get(t, 0.0) for t in self._active() if t != request.tenant]
        return bool(others) and own >= max(others) and own > min(others) + self.bound

    def prefills_first(self, request: Request) -> bool:
        """A running prompt goes before the waiting requests only if its tenant is less served
        than every other backlogged one (a tenant back from idle is level with the least served
        active one: it goes first): otherwise a flooding tenant's long prompts, chunk after
        chunk, would take the budget that a light tenant's new request needs now. Within a
        tenant, running prompts go first."""
        own = self._counters.get(request.tenant, 0.0)
        return all(own < self._counters[tenant] for tenant in self._queues if tenant != request.tenant)

    def order_prefills(self, prompts: list[Request]) -> list[Request]:
        """The least-served tenant's prompts first (within a tenant, in running order): in running
        order, a flooding tenant's older prompts took a step's budget before the rest of a light
        tenant's prompt admitted a step earlier, whenever no other tenant had a request queued (the
        simulated fairness benchmark's seed 3: 0.64 s to a light request's first token)."""
        return sorted(prompts, key=lambda r: self._counters.get(r.tenant, 0.0))

    def charge(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        service = PROMPT_PRICE * prompt_tokens + OUTPUT_PRICE * output_tokens
        tenant = request.tenant
        self._counters[tenant] = self._counters.get(tenant, 0.0) + service / self.tenants.weight(tenant)

    def started(self, request: Request) -> None:
        self._running[request.tenant] += 1

    def stopped(self, request: Request) -> None:
        self._running[request.tenant] -= 1
        if not self._running[request.tenant]:
            del self._running[request.tenant]

    def counters(self) -> dict[str, float]:
        return dict(self._counters)

    @property
    def num_waiting(self) -> int:
        return sum(map(len, self._queues.values()))

    def _active(self) -> set[str]:
        return set(self._queues) | set(self._running)

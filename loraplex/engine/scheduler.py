"""Continuous batching to a per-step token budget. Running decodes first, then the rest of
prompts already being prefilled (in the policy's order), then chunks of waiting prompts;
requests join and leave at every step. The scheduling policy orders the waiting queue and picks
who is preempted: when KV blocks run out, and when it judges that a waiting request should
displace a running one (whose blocks and place then admit it in the same step). It may also put
a running prompt behind the waiting ones (its tenant has had more than its share): that prompt
then takes only the budget they leave; and it may name requests that start only while a share
of the KV blocks stays free for other tenants (SchedulerConfig.fairness_kv_headroom). Pure
Python.

A victim's KV is swapped out to the host pool when the pool has room (else dropped, and
recomputed when it resumes). A swapped request resumes by copying it back: it is admitted in
one step, its copy runs beside that step, and it computes from the next. Its host copy stays
valid while it runs, so a second swap-out copies only the blocks written since; the pool takes
such copies back when it needs room.

A waiting request runs only once its adapter is in a device slot; until then it holds no
running place, and requests behind it may go first. How far they may: a request is overtaken
only while its adapter is being read into host memory or copied into a slot. Once it waits for
a slot that running requests hold, or for room in the host tier, no request behind it takes a
slot or starts a host load, so the next slot or room that frees is its own. Requests behind it
may still join the slots that running requests hold, but one: the slot whose holders end first
if each runs to its max_tokens, kept for it; so it waits at most until they end (sooner if
another slot frees first, or the policy preempts the one request that holds a slot, as it may
for KV blocks or for that slot).

Steps may overlap: `advance` counts a launched step's work at once (the tokens it samples are
pending), so the next step can be planned while the device still runs this one; `commit`
records each token when it reaches the host."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator

from loraplex.engine.adapter_cache import AdapterCache, Wait
from loraplex.engine.block_manager import BlockManager, HostBlockPool
from loraplex.engine.plan import NewSequence, StepPlan
from loraplex.engine.policy import SchedulingPolicy
from loraplex.engine.prefix_cache import block_hashes
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.stats import ADAPTER_WAIT_BUCKETS, Histogram
from loraplex.engine.streaming import blocks_to_drop, max_cached_tokens, sink_blocks
from loraplex.engine_config import SchedulerConfig
from loraplex.types import FinishReason

MAX_PROMPT_DELAY_S = 0.5
"""The longest a prompt step's duration counts for SchedulerConfig.scheduler_delay_factor."""
FAIRNESS_LOOKAHEAD = 16
"""With every running place taken, how far down the waiting line the scheduler looks for the
first request that could start now (its adapter here), the one a fairness preemption is for."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, adapters: AdapterCache,
                 policy: SchedulingPolicy, host_blocks: HostBlockPool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`host_blocks`: the host pool that victims are swapped to (None: always recompute);
        `clock`: what adapter waits are timed by (the slot simulation's is virtual)."""
        self.config, self.blocks, self.adapters, self.policy = config, blocks, adapters, policy
        self._clock = clock
        self.adapter_wait = Histogram(ADAPTER_WAIT_BUCKETS)
        """Each ended request's time waiting for its adapter (requests with one)."""
        self.host_blocks = host_blocks
        self.running: list[Request] = []
        self.adapter_waits: dict[str, Wait] = {}
        """Requests that the last plan left waiting for their adapter, and why (behind a request
        that waits for a slot or host room, a request waits for the same)."""
        self.kept_slot: str | None = None
        """The adapter whose held slot the last plan kept for the first request waiting for a
        slot (no request joins it), or None if none waits for one."""
        self._forgotten: list[str] = []
        self._loading_tenants: set[str] = set()  # this plan: tenants with a request ahead waiting
        self._num_loading = 0  # for its adapter, and how many such requests
        self.preemptions: Counter[tuple[str, str]] = Counter()
        """(cause: "kv" or "fairness", mode: "swap" or "recompute") -> preemptions."""
        self.num_blocks_swapped_out = self.num_blocks_swapped_in = 0
        self._asked: list[Request] = []  # to preempt at the next step
        self._capped: set[str] = set()  # this step's tenants whose prompt chunks share the cap
        self._capped_left = 0  # prompt tokens the cap has left in this step
        self.delays_prompts = False
        """Whether new prompts wait by SchedulerConfig.scheduler_delay_factor: set by an engine
        whose pure decode steps replay CUDA graphs (prompt steps run eagerly)."""
        self._prompt_plan_at: float | None = None  # the last plan, if it computed prompt tokens
        self._prompt_step_end: float | None = None  # the plan after the last one that computed
        self._prompt_step_s = 0.0  # prompt tokens, and the time between the two

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions.values())

    @property
    def num_waiting(self) -> int:
        return self.policy.num_waiting

    @property
    def num_unfinished(self) -> int:
        return self.policy.num_waiting + len(self.running)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        if self.blocks.enable_prefix_caching and not request.block_hashes:  # (the engine's may be set)
            request.block_hashes = block_hashes(request.prompt_token_ids, self.blocks.block_size,
                                                request.tenant, request.adapter)
        if request.adapter is not None:
            self.adapters.need(request.adapter)
        self.policy.add(request)

    def schedule(self) -> StepPlan:
        self.blocks.start_step()
        self.adapters.poll()
        plan = StepPlan(forgotten_ids=self._forgotten)
        self._forgotten = []
        scheduled: dict[str, int] = {}
        budget = self.config.max_num_batched_tokens
        preempted: set[str] = set()
        for request in self._asked:
            if request.status is RequestStatus.RUNNING:
                self._preempt(request, plan, "asked")
                preempted.add(request.request_id)
        self._asked = []
        active = [r for r in self.running if r.has_tokens_to_compute]
        decodes = [r for r in active if r.num_tokens - r.num_computed_tokens == 1]
        prefills = self.policy.order_prefills([r for r in active if r.num_tokens - r.num_computed_tokens > 1])
        self._capped = self.policy.capped_tenants(decodes) if self.config.max_capped_prefill_tokens else set()
        self._capped_left = self.config.max_capped_prefill_tokens
        first: list[Request] = []
        later: list[Request] = []
        for request in prefills:
            (first if self.policy.prefills_first(request) else later).append(request)
        for request in decodes + first:
            if budget == 0:
                break
            if request.request_id in preempted:
                continue
            num_new = self._chunk(request, budget)
            if num_new == 0:
                continue
            if self._reserve_running(request, num_new, plan, scheduled, preempted):
                scheduled[request.request_id] = num_new
                budget -= num_new
                self._charge_cap(request, num_new)
        now = self._clock() if self.delays_prompts else 0.0
        if self._prompt_plan_at is not None:  # (an engine with requests running plans back to back)
            self._prompt_step_s = min(now - self._prompt_plan_at, MAX_PROMPT_DELAY_S)
            self._prompt_step_end = now
        prompts = not self._delays_prompts(now, decodes, prefills, budget)
        if not preempted:
            budget, blocked = self._admit_waiting(budget, plan, scheduled, prompts=prompts)
            if blocked is not None:
                freed = self._make_room(blocked, plan, scheduled)
                if freed is not None:  # the victim's blocks and place are free now: admit again
                    victim_id, victim_tokens = freed
                    preempted.add(victim_id)
                    budget, _ = self._admit_waiting(budget + victim_tokens, plan, scheduled, skip=preempted)
        for request in later:  # what the admitted requests left, without preempting for it
            if budget == 0:
                break
            if request.request_id in preempted or request.status is not RequestStatus.RUNNING:
                continue
            num_new = self._chunk(request, budget)
            if num_new and self._reserve(request, num_new, plan):
                scheduled[request.request_id] = num_new
                budget -= num_new
                self._charge_cap(request, num_new)
        self._fill(plan, scheduled)
        if self.delays_prompts:
            self._prompt_plan_at = now if any(n > 1 for n in scheduled.values()) else None
        return plan

    def _delays_prompts(self, now: float, decodes: list[Request], prefills: list[Request],
                        budget: int) -> bool:
        """Whether waiting prompts stay waiting this step (SchedulerConfig.scheduler_delay_factor):
        the step would replay a decode graph, less than the factor times the last step that
        computed prompt tokens has passed since it ended, and the waiting prompts would not fill
        the budget."""
        factor = self.config.scheduler_delay_factor
        if not self.delays_prompts or factor == 0 or not decodes or prefills or self._prompt_step_end is None:
            return False
        if now - self._prompt_step_end >= factor * self._prompt_step_s:
            return False
        waiting_tokens = 0
        for request in self.policy.waiting():
            waiting_tokens += request.num_tokens - request.num_computed_tokens
            if waiting_tokens >= budget:
                return False
        return True

    def preempt(self, request: Request) -> None:
        """Preempt `request` at the next step if it still runs then (as the policy would)."""
        self._asked.append(request)

    def _make_room(self, blocked: Request, plan: StepPlan, scheduled: dict[str, int],
                   for_slot: bool = False) -> tuple[str, int] | None:
        """`blocked` found no running place or KV blocks (`for_slot`: no device slot): let the
        policy preempt a request that ran before this step for it (for a slot, one that holds
        its slot alone, so that the slot frees). Returns the victim's id and the tokens it had
        been given in this step, or None if the policy lets `blocked` wait."""
        if not for_slot and self._place_frees_soon():
            return None
        new = {seq.request_id for seq in plan.new}
        candidates = [r for r in self.running if r.request_id not in new]
        if for_slot:
            holders = Counter(r.adapter for r in self.running)
            candidates = [r for r in candidates if r.adapter is not None and holders[r.adapter] == 1]
        victim = self.policy.fairness_victim(candidates, blocked) if candidates else None
        if victim is None or victim.tenant == blocked.tenant:
            return None
        tokens = scheduled.pop(victim.request_id, 0)
        self._preempt(victim, plan, "fairness")
        return victim.request_id, tokens

    def _place_frees_soon(self) -> bool:
        """Every running place is taken and a running request will end by length within
        SchedulerConfig.fairness_patience_tokens steps (its place then goes to the first in line)."""
        patience = self.config.fairness_patience_tokens
        if patience == 0 or len(self.running) < self.config.max_num_seqs:
            return False
        return any(r.num_computed_tokens >= r.num_prompt_tokens
                   and r.max_num_tokens - r.num_tokens <= patience for r in self.running)

    def _reserve_running(
        self, request: Request, num_new: int, plan: StepPlan, scheduled: dict[str, int],
        preempted: set[str],
    ) -> bool:
        """Blocks for `num_new` more tokens of a running request, preempting the policy's
        victims while short. False if the request itself had to go."""
        while not self._reserve(request, num_new, plan):
            victim = self.policy.choose_victim(self.running)
            scheduled.pop(victim.request_id, None)
            self._preempt(victim, plan, "kv")
            preempted.add(victim.request_id)
            if victim is request:
                return False
        return True

    def _admit_waiting(self, budget: int, plan: StepPlan, scheduled: dict[str, int],
                       skip: Collection[str] = (), prompts: bool = True) -> tuple[int, Request | None]:
        """Admit waiting requests in the policy's order (but those in `skip`, and without
        `prompts` all but swapped requests, which resume without computing) while the budget,
        the running places and the KV cache allow; then start host loads for the adapters of
        those next in line. Returns the budget left and the first request kept out for want of
        a running place or KV blocks."""
        no_slots = no_host_room = False  # someone ahead waits for a slot / for host room
        held: set[str] = set()  # tenants that leave the KV headroom to others: they start nothing more
        self.adapter_waits = {}
        self._loading_tenants = set()
        self._num_loading = 0
        self.kept_slot = None
        waiting = self.policy.waiting()
        for request in waiting:
            full = len(self.running) >= self.config.max_num_seqs
            if budget == 0 or full:
                line = [request, *itertools.islice(waiting, FAIRNESS_LOOKAHEAD if full else 0)]
                if not no_host_room:
                    self._prefetch(itertools.chain(line, waiting))
                # Room is made for the first in line whose adapter is here (on the device or in
                # host memory): a place freed for one still loading its adapter goes to whoever
                # is behind it, and the victim's tenant pays a preemption for nothing.
                return budget, next((r for r in line if self._adapter_is_here(r)), None) if full else None
            if request.num_pending or request.request_id in skip or request.tenant in held:
                continue  # a token in flight, just preempted, or its tenant leaves the headroom
            if not prompts and not request.is_swapped:
                continue
            if request.documents is not None:  # the engine blends its documents first
                continue
            if not self._share_prompt(request):  # its donor has not computed the shared blocks yet
                continue
            if self._waits_for_prefix(request):  # another request is computing its next block
                continue
            if (self.config.hold_places_for_loading
                    and len(self.running) + self._num_loading >= self.config.max_num_seqs
                    and self.policy.holds_back(request, self.config.max_num_seqs, self._loading_tenants)):
                continue  # the free places are for those ahead waiting for their adapters
            slot = 0
            if request.adapter is not None:
                has_slot = self.adapters.slot_of(request.adapter) is not None
                if ((no_slots and (not has_slot or request.adapter == self.kept_slot))
                        or (no_host_room and not has_slot)):
                    self._wait_for_adapter(request, Wait.NO_SLOT if no_slots else Wait.NO_HOST_ROOM)
                    continue
                acquired = self.adapters.acquire(request.adapter)
                if acquired is Wait.NO_SLOT and not no_slots:
                    freed = self._make_room(request, plan, scheduled, for_slot=True)
                    if freed is not None:  # the victim's slot is free now
                        budget += freed[1]
                        acquired = self.adapters.acquire(request.adapter)
                if isinstance(acquired, Wait):
                    self._wait_for_adapter(request, acquired)
                    # Slots free as their holders finish and copies end. Host room frees as the
                    # requests that need its adapters end; with none running, none would.
                    if acquired is Wait.NO_SLOT and not no_slots:
                        no_slots, self.kept_slot = True, self._first_to_free()
                    no_host_room |= acquired is Wait.NO_HOST_ROOM and bool(self.running)
                    continue
                slot = acquired
                self._end_adapter_wait(request)
            swapped = request.is_swapped
            cached = self._take_cached_prefix(request)
            swapped = swapped and request.num_computed_tokens > 0  # (its prefix may be evicted)
            num_new = 0 if swapped else self._chunk(request, budget)
            if num_new == 0 and not swapped:  # its tenant's prompt tokens are capped this step
                if slot:
                    self.adapters.release(request.adapter)
                self._return_cached_prefix(request, cached, swapped)
                continue
            if self._takes_headroom(request, num_new):  # the blocks left are for tenants behind it
                held.add(request.tenant)
                if slot:
                    self.adapters.release(request.adapter)
                self._return_cached_prefix(request, cached, swapped)
                continue
            if not self._reserve(request, num_new, plan):
                if slot:
                    self.adapters.release(request.adapter)
                self._return_cached_prefix(request, cached, swapped)
                return budget, request
            if swapped and request.has_remote_kv:  # received before the next step (but its cached prefix)
                plan.receive[request.request_id] = (cached, request.block_ids[cached:])
                request.has_remote_kv = False
            elif swapped:  # copied back beside this step (but its cached prefix); it computes from the next
                plan.swap_in += zip(request.host_block_ids, request.block_ids[cached:])
                self.num_blocks_swapped_in += len(request.block_ids) - cached
            self._start(request, slot, plan)
            if not swapped:
                scheduled[request.request_id] = num_new
                budget -= num_new
                self._charge_cap(request, num_new)
        return budget, None

    def _takes_headroom(self, request: Request, num_new: int) -> bool:
        """Whether starting `request` with `num_new` tokens (none if it resumes from its host copy)
        would leave fewer KV blocks free than SchedulerConfig.fairness_kv_headroom keeps, while
        the policy says it should leave them to the tenants behind its own."""
        headroom = int(self.config.fairness_kv_headroom * self.blocks.max_kv_blocks)
        if headroom == 0 or not self.policy.leaves_headroom(request):
            return False
        needed = self.blocks.blocks_needed(request.num_cached_tokens + num_new, len(request.block_ids))
        return self.blocks.num_available_blocks - needed < headroom

    def _adapter_is_here(self, request: Request) -> bool:
        return request.adapter is None or self.adapters.is_here(request.adapter)

    def _wait_for_adapter(self, request: Request, why: Wait) -> None:
        self.adapter_waits[request.request_id] = why
        self._loading_tenants.add(request.tenant)
        self._num_loading += 1
        if request.adapter_wait_since is None:
            request.adapter_wait_since = self._clock()

    def _end_adapter_wait(self, request: Request) -> None:
        if request.adapter_wait_since is not None:
            request.adapter_wait_s += self._clock() - request.adapter_wait_since
            request.adapter_wait_since = None

    def _chunk(self, request: Request, budget: int) -> int:
        """Tokens `request` may compute this step: what it has left, within the step's budget,
        and for a prompt of a capped tenant within what the cap has left."""
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        if request.streaming is not None:  # its blocks hold at most max_cached_tokens
            window, bs = request.streaming, self.blocks.block_size
            kept = request.num_cached_tokens - bs * blocks_to_drop(
                window, bs, request.num_computed_tokens, request.num_dropped_tokens)
            num_new = min(num_new, max_cached_tokens(window, bs) - kept)
        if num_new > 1 and request.tenant in self._capped:
            num_new = min(num_new, self._capped_left)
        return num_new

    def _charge_cap(self, request: Request, num_new: int) -> None:
        if num_new > 1 and request.tenant in self._capped:
            self._capped_left -= num_new

    def _first_to_free(self) -> str | None:
        """The adapter whose slot frees first if every running request runs to its length
        limit: the one whose longest-running holder has the fewest tokens left."""
        left: dict[str, int] = {}
        for request in self.running:
            if request.adapter is not None:
                tokens = request.max_num_tokens - request.num_tokens
                left[request.adapter] = max(left.get(request.adapter, 0), tokens)
        return min(left, key=left.__getitem__, default=None)

    def _share_prompt(self, request: Request) -> bool:
        """For a sample of a prompt that another sample (its donor) computes: take references to
        the donor's blocks that hold nothing but prompt (the last prompt token is computed by
        each sample: it samples from it). False while the donor has yet to compute them."""
        donor = request.prompt_donor
        if donor is None or request.block_ids or request.num_computed_tokens:
            return True
        shared = (request.num_prompt_tokens - 1) // self.blocks.block_size
        if donor.is_finished or shared == 0:
            request.prompt_donor = None  # alone from now on
            return True
        needed = shared * self.blocks.block_size
        if donor.status is RequestStatus.WAITING or donor.num_computed_tokens < needed:
            return False
        request.block_ids = donor.block_ids[:shared]
        self.blocks.share(request.block_ids)
        request.num_computed_tokens = needed
        return True

    def _max_cached_blocks(self, request: Request) -> int:
        """Prompt blocks a fresh request may take from the prefix cache: it computes at least
        its last prompt token (it samples from it); one that scores its prompt takes none."""
        if request.params.prompt_logprobs is not None:
            return 0
        return (request.num_prompt_tokens - 1) // self.blocks.block_size

    def _waits_for_prefix(self, request: Request) -> bool:
        """A fresh request waits while a running request's step is about to write its next
        prompt block: it finds that block cached at the next step instead of computing it."""
        if request.block_ids or request.num_computed_tokens or not request.block_hashes:
            return False
        hashes = request.block_hashes[:self._max_cached_blocks(request)]
        num_hits = self.blocks.num_hits(hashes)
        return num_hits < len(hashes) and self.blocks.is_computing(hashes[num_hits])

    def _take_cached_prefix(self, request: Request) -> int:
        """References to the cached blocks that start a request holding no blocks; returns how
        many it took. A swapped request takes back the prefix it left on the device (its host
        copy holds the rest), or, if that was evicted since, drops its host copy and computes
        again."""
        if request.block_ids or not request.block_hashes:
            return 0
        if request.is_swapped and request.has_remote_kv:  # (what this engine has cached it need not receive)
            request.block_ids = self.blocks.match(request.block_hashes, len(request.block_hashes))
            return len(request.block_ids)
        if request.is_swapped:
            num_prefix = request.num_swap_prefix_blocks
            if num_prefix == 0:
                return 0
            request.block_ids = self.blocks.match(request.block_hashes, num_prefix)
            if len(request.block_ids) == num_prefix:
                return num_prefix
            self.blocks.free(request.block_ids)
            request.block_ids, request.num_computed_tokens = [], 0
            self._drop_host_copy(request)
        if request.num_computed_tokens:
            return 0
        request.block_ids = self.blocks.match(request.block_hashes, self._max_cached_blocks(request))
        request.num_computed_tokens = len(request.block_ids) * self.blocks.block_size
        return len(request.block_ids)

    def _return_cached_prefix(self, request: Request, num_cached: int, swapped: bool) -> None:
        """Undo `_take_cached_prefix` for a request that stays waiting."""
        if num_cached:
            self.blocks.free(request.block_ids)
            request.block_ids = []
            if not swapped:
                request.num_computed_tokens = 0

    def _prefetch(self, upcoming: Iterator[Request]) -> None:
        """Start host loads of the adapters of the next requests in line, while there is room;
        and copies of those in host memory into slots whose pages the pool has free beyond what
        the running requests may still grow into (the pool's idle memory as an adapter cache:
        the request then finds its adapter resident when a running place frees)."""
        headroom = None
        for request in itertools.islice(upcoming, self.adapters.max_resident):
            if request.adapter is None:
                continue
            if not self.adapters.prefetch(request.adapter):
                return
            if self.adapters.slot_of(request.adapter) is None and self.adapters.can_stage:
                if headroom is None:
                    headroom = self.blocks.num_free_blocks - self._kv_growth()
                if headroom < self.adapters.slot_blocks:
                    continue
                if self.adapters.stage(request.adapter):
                    headroom -= self.adapters.slot_blocks

    def _kv_growth(self) -> int:
        """Blocks the running requests would add if each ran to its length limit."""
        bs = self.blocks.block_size
        return sum(self.blocks.blocks_needed(
            r.max_num_tokens if r.streaming is None else min(r.max_num_tokens,
                                                             max_cached_tokens(r.streaming, bs)),
            len(r.block_ids)) for r in self.running)

    def _start(self, request: Request, slot: int, plan: StepPlan) -> None:
        self.policy.remove(request)
        self.policy.started(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        plan.new.append(NewSequence(
            request_id=request.request_id, token_ids=list(request.token_ids),
            num_prompt_tokens=request.num_prompt_tokens, block_ids=list(request.block_ids),
            num_computed_tokens=request.num_computed_tokens, adapter_slot=slot,
            params=request.params, seed=request.seed, num_dropped_tokens=request.num_dropped_tokens,
        ))
        plan.new_block_ids.pop(request.request_id, None)

    def _reserve(self, request: Request, num_new: int, plan: StepPlan) -> bool:
        if request.streaming is not None and request.status is RequestStatus.RUNNING:
            self._slide(request, plan)
        needed = self.blocks.blocks_needed(request.num_cached_tokens + num_new, len(request.block_ids))
        if needed == 0:
            return True
        new_blocks = self.blocks.allocate(needed)
        if new_blocks is None:
            return False
        first = len(request.block_ids)
        if first * self.blocks.block_size >= request.num_computed_tokens:  # blocks this step writes
            self.blocks.register(new_blocks, request.block_hashes[first:])
        request.block_ids.extend(new_blocks)
        plan.new_block_ids.setdefault(request.request_id, []).extend(new_blocks)
        return True

    def _slide(self, request: Request, plan: StepPlan) -> None:
        """Attention sinks: drop the window blocks that fell behind the window (back to the pool);
        the runner rotates the keys of those after them back by the tokens dropped. Its host copy
        no longer matches its blocks: dropped."""
        window, bs = request.streaming, self.blocks.block_size
        count = blocks_to_drop(window, bs, request.num_computed_tokens, request.num_dropped_tokens)
        if count == 0:
            return
        first = sink_blocks(window, bs)
        dropped = request.block_ids[first:first + count]
        del request.block_ids[first:first + count]
        self.blocks.free(dropped)
        request.num_dropped_tokens += count * bs
        self._drop_host_copy(request)
        previous = plan.dropped_blocks.get(request.request_id)  # (only once a step: scheduled once)
        plan.dropped_blocks[request.request_id] = (first, count + (previous[1] if previous else 0))

    def _fill(self, plan: StepPlan, scheduled: dict[str, int]) -> None:
        by_id = {r.request_id: r for r in self.running}
        for request_id, num_new in scheduled.items():
            request = by_id[request_id]
            plan.request_ids.append(request_id)
            plan.num_scheduled_tokens.append(num_new)
            plan.samples.append(request.num_computed_tokens + num_new == request.num_tokens
                                and not request.params.is_scoring_only)

    def advance(self, plan: StepPlan) -> list[Request]:
        """Count a launched step's work: its tokens are computed, the ones it samples pending.
        Returns the requests that sample, in plan order."""
        by_id = {r.request_id: r for r in self.running}
        sampling = []
        for request_id, num_new, samples in zip(plan.request_ids, plan.num_scheduled_tokens, plan.samples):
            request = by_id[request_id]
            if request.block_hashes and request.num_computed_tokens < request.num_prompt_tokens:
                # cached prompt blocks this step completes (none once the prompt is done)
                bs, computed = self.blocks.block_size, request.num_computed_tokens
                end = min((computed + num_new) // bs, len(request.block_hashes))
                self.blocks.mark_computed(request.block_ids[computed // bs:end])
            request.num_computed_tokens += num_new
            prompt = max(0, min(request.num_computed_tokens, request.num_prompt_tokens)
                         - request.num_prompt_charged)
            request.num_prompt_charged += prompt
            if samples:
                request.num_pending += 1
                sampling.append(request)
            self.policy.charge(request, prompt, int(samples))
        return sampling

    @staticmethod
    def commit(request: Request, token: int) -> None:
        """A pending token of `request` has reached the host."""
        request.num_pending -= 1
        request.token_ids.append(token)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request (done, aborted or failed): every block and its adapter slot return."""
        if request.is_finished:
            return
        self.blocks.free(self.hand_off(request))
        request.finish_reason = reason

    def hand_off(self, request: Request) -> list[int]:
        """Take a request out of this scheduler as `finish` does, but for another engine to
        continue (disaggregated prefill: its first token is sampled): its block references pass
        to the caller, who frees them once their KV is copied ([] if it holds none: preempted
        since it sampled, it is computed again there)."""
        block_ids, request.block_ids = request.block_ids, []
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.policy.stopped(request)
            self._forgotten.append(request.request_id)
            if request.adapter is not None:
                self.adapters.release(request.adapter)
        else:
            self.policy.remove(request)
        self._drop_host_copy(request)
        if request.adapter is not None:
            self.adapters.unneed(request.adapter)
            self._end_adapter_wait(request)
            self.adapter_wait.observe(request.adapter_wait_s)
        request.status = RequestStatus.FINISHED
        return block_ids

    def recompute(self, request: Request) -> None:
        """A waiting request drops its host copy (its swap-out may not have run) and computes
        its KV again when it resumes."""
        self._drop_host_copy(request)
        request.num_computed_tokens = request.num_dropped_tokens = 0

    def _preempt(self, request: Request, plan: StepPlan, cause: str) -> None:
        self.running.remove(request)
        self.policy.stopped(request)
        swapped = self._swap_out(request, plan)
        self._release(request)
        plan.forgotten_ids.append(request.request_id)
        plan.new_block_ids.pop(request.request_id, None)
        plan.num_preempted += 1
        if not swapped:
            request.num_computed_tokens = request.num_dropped_tokens = 0
            self._drop_host_copy(request)
        self.preemptions[cause, "swap" if swapped else "recompute"] += 1
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.policy.add(request)

    def _release(self, request: Request) -> None:
        self.blocks.free(request.block_ids)
        request.block_ids = []
        if request.adapter is not None:
            self.adapters.release(request.adapter)

    # Swapping ------------------------------------------------------------------------------
    def _swap_out(self, request: Request, plan: StepPlan) -> bool:
        """Queue the copy of a victim's computed KV to the host pool: only the blocks its host
        copy does not hold yet, and none of the leading cached blocks that others hold too (a
        pinned system prompt, another request's prompt: they stay on the device, and it finds
        them again when it resumes). Its own prompt blocks are copied like the rest: left on the
        device as evictable cache, they would be evicted by the pressure that preempts it, and
        it would compute its whole prompt again (which cost light tenants 10x their p99 TTFT in
        the fairness benchmark). False (nothing queued) if the pool has no room."""
        bs = self.blocks.block_size
        num_blocks = -(-request.num_cached_tokens // bs)
        if self.host_blocks is None or num_blocks == 0:
            return False
        if not request.num_host_tokens:
            request.num_swap_prefix_blocks = min(self.blocks.num_shared_prefix(request.block_ids),
                                                 len(request.block_hashes), num_blocks)
        prefix = request.num_swap_prefix_blocks
        more = num_blocks - prefix - len(request.host_block_ids)
        if more > 0:
            blocks = self._allocate_host(more)
            if blocks is None:
                return False
            request.host_block_ids += blocks
        valid = max(prefix, min(request.num_host_tokens, request.num_cached_tokens) // bs)
        plan.swap_out += zip(request.block_ids[valid:num_blocks], request.host_block_ids[valid - prefix:])
        self.num_blocks_swapped_out += num_blocks - valid
        request.num_host_tokens = request.num_cached_tokens
        request.prompt_donor = None  # its own blocks from now on
        return True

    def _allocate_host(self, count: int) -> list[int] | None:
        """Host blocks, taking back the copies that running requests keep if need be."""
        blocks = self.host_blocks.allocate(count)
        keepers = (r for r in self.running if r.host_block_ids)
        while blocks is None and (keeper := next(keepers, None)) is not None:
            self._drop_host_copy(keeper)
            blocks = self.host_blocks.allocate(count)
        return blocks

    def _drop_host_copy(self, request: Request) -> None:
        if request.host_block_ids:
            self.host_blocks.free(request.host_block_ids)
            request.host_block_ids = []
        request.num_host_tokens = 0

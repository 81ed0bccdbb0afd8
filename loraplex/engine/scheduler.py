"""Continuous batching to a per-step token budget. Running decodes first, then the rest of
prompts already being prefilled, then chunks of waiting prompts; requests join and leave at
every step. When KV blocks run out, the most recently admitted request is preempted (its cache
dropped, recomputed on resume). Pure Python.

Steps may overlap: `advance` counts a launched step's work at once (the tokens it samples are
pending), so the next step can be planned while the device still runs this one; `commit`
records each token when it reaches the host."""

from __future__ import annotations

from loraplex.engine.adapter_slots import AdapterSlots
from loraplex.engine.block_manager import BlockManager
from loraplex.engine.plan import NewSequence, StepPlan
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine_config import SchedulerConfig
from loraplex.types import FinishReason


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, slots: AdapterSlots) -> None:
        self.config, self.blocks, self.slots = config, blocks, slots
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._forgotten: list[str] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> StepPlan:
        plan = StepPlan(forgotten_ids=self._forgotten)
        self._forgotten = []
        scheduled: dict[str, int] = {}
        budget = self.config.max_num_batched_tokens
        preempted: set[str] = set()
        active = [r for r in self.running if r.has_tokens_to_compute]
        decodes = [r for r in active if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in active if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.request_id in preempted:
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._reserve_running(request, num_new, plan, scheduled, preempted):
                scheduled[request.request_id] = num_new
                budget -= num_new
        if not preempted:
            budget = self._admit_waiting(budget, plan, scheduled)
        self._fill(plan, scheduled)
        return plan

    def _reserve_running(
        self, request: Request, num_new: int, plan: StepPlan, scheduled: dict[str, int],
        preempted: set[str],
    ) -> bool:
        """Blocks for `num_new` more tokens of a running request, preempting the most recently
        admitted requests while short. False if the request itself had to go."""
        while not self._reserve(request, num_new, plan):
            victim = self.running[-1]
            scheduled.pop(victim.request_id, None)
            self._preempt(victim, plan)
            preempted.add(victim.request_id)
            if victim is request:
                return False
        return True

    def _admit_waiting(self, budget: int, plan: StepPlan, scheduled: dict[str, int]) -> int:
        still_waiting = []
        for index, request in enumerate(self.waiting):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                still_waiting.extend(self.waiting[index:])
                break
            if request.num_pending or (
                    request.adapter is not None and not self.slots.can_acquire(request.adapter)):
                # preempted with a token still in flight, or every slot is held: try the others
                still_waiting.append(request)
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve(request, num_new, plan):
                still_waiting.extend(self.waiting[index:])
                break
            slot = self._acquire_slot(request, plan)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.new.append(NewSequence(
                request_id=request.request_id, token_ids=list(request.token_ids),
                num_prompt_tokens=request.num_prompt_tokens, block_ids=list(request.block_ids),
                num_computed_tokens=request.num_computed_tokens, adapter_slot=slot,
                params=request.params, seed=request.seed,
            ))
            plan.new_block_ids.pop(request.request_id, None)
            scheduled[request.request_id] = num_new
            budget -= num_new
        self.waiting = still_waiting
        return budget

    def _acquire_slot(self, request: Request, plan: StepPlan) -> int:
        if request.adapter is None:
            return 0
        acquired = self.slots.acquire(request.adapter)
        assert acquired is not None, "can_acquire said yes"
        slot, needs_load = acquired
        if needs_load:
            plan.adapter_loads.append((slot, request.adapter))
        return slot

    def _reserve(self, request: Request, num_new: int, plan: StepPlan) -> bool:
        needed = self.blocks.blocks_needed(request.num_computed_tokens + num_new, len(request.block_ids))
        if needed == 0:
            return True
        new_blocks = self.blocks.allocate(needed)
        if new_blocks is None:
            return False
        request.block_ids.extend(new_blocks)
        plan.new_block_ids.setdefault(request.request_id, []).extend(new_blocks)
        return True

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
            request.num_computed_tokens += num_new
            if samples:
                request.num_pending += 1
                sampling.append(request)
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
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._release(request)
            self._forgotten.append(request.request_id)
        elif request in self.waiting:
            self.waiting.remove(request)
            self.blocks.free(request.block_ids)
            request.block_ids = []
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.running.remove(request)
        self._release(request)
        plan.forgotten_ids.append(request.request_id)
        plan.new_block_ids.pop(request.request_id, None)
        plan.num_preempted += 1
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, request)

    def _release(self, request: Request) -> None:
        self.blocks.free(request.block_ids)
        request.block_ids = []
        if request.adapter is not None:
            self.slots.release(request.adapter)

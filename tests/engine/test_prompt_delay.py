"""SchedulerConfig.scheduler_delay_factor: where decode steps replay CUDA graphs and prompt steps
run eagerly, new prompts wait until the time since the last prompt step ended reaches the factor
times that step's duration, so arrivals gather into fewer eager steps. The real Scheduler, BlockManager
and FcfsPolicy on a virtual clock: a step that computes prompt tokens takes PROMPT_STEP_S, a pure
decode step DECODE_STEP_S (as on the H100: an eager step of 32 decodes and a 256-token prompt
42.6 ms, the same decodes from a graph 8.9 ms)."""

from __future__ import annotations

import pytest

from loraplex.engine.block_manager import BlockManager, HostBlockPool
from loraplex.engine.policy import FcfsPolicy
from loraplex.engine.request import Request
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.tenants import TenantTable
from loraplex.engine_config import SchedulerConfig
from loraplex.types import SamplingParams

PROMPT_STEP_S = 0.040
DECODE_STEP_S = 0.010
BUDGET = 512


class NoAdapters:
    num_slots = max_resident = 0

    def poll(self) -> None:
        pass


class Clocked:
    """A scheduler whose steps advance a virtual clock by their kind's duration."""

    def __init__(self, factor: float = 1.0, graphs: bool = True) -> None:
        self.now = 0.0
        config = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=BUDGET, scheduling_policy="fcfs",
                                 scheduler_delay_factor=factor)
        self.blocks = BlockManager(1024, 16)
        self.scheduler = Scheduler(config, self.blocks, NoAdapters(), FcfsPolicy(TenantTable()),
                                   HostBlockPool(1024), clock=lambda: self.now)
        self.scheduler.delays_prompts = graphs
        self.count = 0
        self.prompt_steps = 0
        self.started_at: dict[str, float] = {}

    def add(self, prompt_len: int = 64, max_tokens: int = 1000) -> str:
        request_id = f"r{self.count}"
        self.scheduler.add(Request(request_id=request_id, prompt_token_ids=[1] * prompt_len,
                                   params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=0,
                                   arrival=self.count, tenant="t", max_num_tokens=prompt_len + max_tokens))
        self.count += 1
        return request_id

    def step(self) -> list[str]:
        """One step; returns the ids of the requests it started."""
        plan = self.scheduler.schedule()
        started = [seq.request_id for seq in plan.new]
        for request_id in started:
            self.started_at[request_id] = self.now
        for request in self.scheduler.advance(plan):
            self.scheduler.commit(request, 1)
            if request.num_tokens >= request.max_num_tokens:
                self.scheduler.finish(request, "length")
        computes_prompts = any(n > 1 for n in plan.num_scheduled_tokens)
        self.prompt_steps += computes_prompts
        self.now += PROMPT_STEP_S if computes_prompts else DECODE_STEP_S
        return started

    def running_decodes(self, count: int) -> None:
        """`count` requests decoding, their prompts long done (twenty decode steps ago)."""
        for _ in range(count):
            self.add()
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in self.scheduler.running) \
                or self.scheduler.num_waiting:
            self.step()
        for _ in range(20):
            self.step()


def test_a_prompt_arriving_right_after_a_prompt_step_waits_for_that_steps_duration():
    sim = Clocked(factor=1.0)
    sim.running_decodes(4)
    first = sim.add()
    assert sim.step() == [first]  # the last prompt step was long ago: no wait
    prompt_step_at = sim.started_at[first]
    second = sim.add()
    waited = []
    while (started := sim.step()) != [second]:
        assert started == []
        waited.append(sim.now)
    # it waited through pure decode steps until 1 x the 40 ms prompt step had passed since it ended
    assert len(waited) == PROMPT_STEP_S / DECODE_STEP_S
    assert sim.started_at[second] - prompt_step_at == pytest.approx(2 * PROMPT_STEP_S)


def test_no_wait_without_decode_graphs_or_with_the_factor_at_zero():
    for sim in (Clocked(factor=1.0, graphs=False), Clocked(factor=0.0)):
        sim.running_decodes(4)
        assert sim.step() == [] and sim.add() and sim.step() == [f"r{sim.count - 1}"]
        nxt = sim.add()
        assert sim.step() == [nxt]  # right after the first one's prompt step


def test_no_wait_when_nothing_decodes_or_the_waiting_prompts_fill_the_budget():
    sim = Clocked(factor=1.0)
    sim.running_decodes(4)
    sim.add()
    sim.step()
    big = sim.add(prompt_len=BUDGET)  # fills the step's budget by itself
    assert sim.step() == [big]

    idle = Clocked(factor=1.0)
    idle.running_decodes(1)
    idle.add()
    idle.step()  # a prompt step
    for request in list(idle.scheduler.running):
        idle.scheduler.finish(request, "length")
    late = idle.add()
    assert idle.step() == [late]  # right after the prompt step, but no request decodes


def test_no_wait_when_the_step_computes_a_running_prompts_chunk():
    sim = Clocked(factor=1.0)
    sim.running_decodes(4)
    long_prompt = sim.add(prompt_len=BUDGET + 64)  # takes two steps of chunks
    assert sim.step() == [long_prompt]
    joiner = sim.add()
    assert sim.step() == [joiner]  # the long prompt's next chunk makes this step eager anyway


def test_arrivals_gather_into_fewer_prompt_steps():
    """One arrival every 20 ms for 2 s, 5 tokens each: without the delay every step computes a
    prompt (40 ms each); with it, one eager step then about four graph steps."""
    results = {}
    for factor in (0.0, 1.0):
        sim = Clocked(factor=factor)
        sim.running_decodes(4)
        start, next_arrival, before = sim.now, sim.now, sim.prompt_steps
        steps = 0
        while sim.now < start + 2.0:
            while next_arrival <= sim.now:
                sim.add(max_tokens=5)
                next_arrival += 0.020
            sim.step()
            steps += 1
        results[factor] = (sim.prompt_steps - before, steps, sim.scheduler.num_waiting)
    prompt_steps_plain, steps_plain, _ = results[0.0]
    prompt_steps_delayed, steps_delayed, waiting = results[1.0]
    assert prompt_steps_plain == steps_plain == 50  # every step eager: 50 in 2 s
    assert prompt_steps_delayed <= steps_delayed // 4  # 1 eager, then about 4 graph steps
    assert steps_delayed > 2 * steps_plain
    assert waiting <= 4  # arrivals do not pile up: each eager step takes what came

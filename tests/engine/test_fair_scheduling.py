"""Fair scheduling, simulated: the real Scheduler, BlockManager, host pool and VtcPolicy on a
virtual clock (one step a tick), with a stand-in for the model that samples token 1 for every
request that samples. Base-model requests only, so the adapter tier is a stand-in too.

Service is measured here, from the plans, independently of the policy's own counters: prompt
tokens computed for the first time + 2 x tokens sampled, over the tenant's weight."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from loraplex.engine.block_manager import BlockManager, HostBlockPool
from loraplex.engine.policy import FcfsPolicy, VtcPolicy
from loraplex.engine.request import Request
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.tenants import TenantTable
from loraplex.engine_config import SchedulerConfig
from loraplex.types import SamplingParams

BLOCK_SIZE = 16
MAX_PROMPT = 256
MAX_SEQS = 16
NUM_BLOCKS = 160  # 2,560 tokens: less than 16 requests can hold, so blocks run short too


class NoAdapters:
    """The adapter tier of a base-model-only workload: nothing to load."""

    num_slots = max_resident = 0

    def poll(self) -> None:
        pass

    def prefetch(self, digest: str) -> bool:
        raise AssertionError("no request names an adapter")


class Simulation:
    def __init__(self, policy: str, weights: dict[str, float], bound: float = 1024.0,
                 capped_prefill: int = 1024, kv_headroom: float = 0.0, patience: int = 0) -> None:
        self.tenants = TenantTable()
        for tenant, weight in weights.items():
            self.tenants.set_weight(tenant, weight)
        self.policy = (VtcPolicy(self.tenants, bound) if policy == "vtc" else FcfsPolicy(self.tenants))
        config = SchedulerConfig(max_num_seqs=MAX_SEQS, max_num_batched_tokens=512,
                                 max_capped_prefill_tokens=capped_prefill, fairness_kv_headroom=kv_headroom,
                                 fairness_patience_tokens=patience)
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.host = HostBlockPool(4 * NUM_BLOCKS)
        self.scheduler = Scheduler(config, self.blocks, NoAdapters(), self.policy, self.host)
        self.service: dict[str, float] = defaultdict(float)
        self.tick = 0
        self.arrivals = 0
        self.first_token: dict[str, int] = {}
        self.arrived_at: dict[str, int] = {}
        self.unfinished: dict[str, Request] = {}

    def add(self, tenant: str, prompt_len: int, output_len: int) -> None:
        request_id = f"{tenant}-{self.arrivals}"
        request = Request(request_id=request_id, prompt_token_ids=[1] * prompt_len,
                          params=SamplingParams(max_tokens=output_len, ignore_eos=True), seed=0,
                          arrival=self.arrivals, tenant=tenant, max_num_tokens=prompt_len + output_len)
        self.arrivals += 1
        self.arrived_at[request_id] = self.tick
        self.unfinished[request_id] = request
        self.scheduler.add(request)

    def step(self) -> None:
        plan = self.last_plan = self.scheduler.schedule()
        by_id = {r.request_id: r for r in self.scheduler.running}
        before = {rid: by_id[rid].num_prompt_charged for rid in plan.request_ids}
        for request in self.scheduler.advance(plan):
            self.scheduler.commit(request, 1)
            self.first_token.setdefault(request.request_id, self.tick)
            if request.num_tokens >= request.max_num_tokens:
                self.scheduler.finish(request, "length")
                del self.unfinished[request.request_id]
        for request_id, samples in zip(plan.request_ids, plan.samples):
            request = by_id[request_id]
            prompt = request.num_prompt_charged - before[request_id]
            self.service[request.tenant] += (prompt + 2 * samples) / self.tenants.weight(request.tenant)
        self.tick += 1

    def backlogged(self) -> set[str]:
        return {r.tenant for r in self.unfinished.values()}

    def check_accounting(self) -> None:
        """Blocks and host blocks are held exactly by the requests that hold them."""
        requests = list(self.unfinished.values())
        assert self.blocks.num_used_blocks == len({b for r in requests for b in r.block_ids})
        assert self.host.num_used_blocks == sum(len(r.host_block_ids) for r in requests)


def _jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def _vtc_bound(max_prompt: int) -> float:
    """The VTC paper's 2U, U = max(prompt price x longest prompt, output price x most tokens in
    the running batch), in this simulation's terms (weight 1)."""
    return 2 * max(1 * max_prompt, 2 * NUM_BLOCKS * BLOCK_SIZE)


def test_heavy_tenant_cannot_starve_light_ones_and_service_gaps_stay_bounded():
    """1 heavy tenant sending 4x the requests of each of 3 light tenants, all backlogged from
    the start; then a stream of arrivals keeps them all backlogged."""
    rng = random.Random(0)
    sim = Simulation("vtc", {})
    tenants = ["heavy", "light-1", "light-2", "light-3"]

    def burst(tenant: str, count: int) -> None:
        for _ in range(count):
            sim.add(tenant, rng.randint(16, MAX_PROMPT), rng.randint(8, 96))

    for tenant in tenants:
        burst(tenant, 400 if tenant == "heavy" else 100)
    history: list[dict[str, float]] = []
    while sim.tick < 1000:
        if sim.tick % 50 == 0:  # more arrivals, at the same 4:1 ratio
            for tenant in tenants:
                burst(tenant, 4 if tenant == "heavy" else 1)
        sim.step()
        sim.check_accounting()
        assert sim.backlogged() == set(tenants), "every tenant stays backlogged for the whole run"
        history.append(dict(sim.service))
    # Any two backlogged tenants' service over any interval differs by at most the bound.
    bound = _vtc_bound(MAX_PROMPT)
    worst = 0.0
    for a in tenants:
        for b in tenants:
            diffs = [s.get(a, 0.0) - s.get(b, 0.0) for s in history]
            worst = max(worst, max(diffs) - min(diffs))
    assert worst <= bound, (worst, bound)
    print(f"worst service gap {worst:.0f} (bound {bound:.0f})")
    assert worst <= sim.policy.bound + 512 + 2 * MAX_SEQS  # preemption keeps it near its own bound
    totals = [sim.service[t] for t in tenants]
    assert _jain(totals) >= 0.95, totals
    preemptions = sim.scheduler.preemptions
    assert sum(n for (_, mode), n in preemptions.items() if mode == "swap") > 0, preemptions


def test_fcfs_lets_the_heavy_tenant_take_the_engine():
    """The same burst under first come, first served: the heavy tenant's requests, queued
    first, take nearly all the service, which is what VTC fixes."""
    sim = Simulation("fcfs", {})
    for _ in range(80):
        sim.add("heavy", 128, 64)
    for tenant in ("light-1", "light-2", "light-3"):
        for _ in range(20):
            sim.add(tenant, 128, 64)
    for _ in range(300):
        sim.step()
    lights = sum(sim.service[t] for t in ("light-1", "light-2", "light-3"))
    assert lights < 0.05 * sim.service["heavy"]
    assert _jain([sim.service[t] for t in ("heavy", "light-1", "light-2", "light-3")]) < 0.5


@pytest.mark.parametrize("weights", [(1, 2, 4), (4, 1, 2)])
def test_weights_divide_service_in_proportion(weights):
    names = ["a", "b", "c"]
    sim = Simulation("vtc", dict(zip(names, weights)))
    rng = random.Random(1)
    for tenant in names:
        for _ in range(200):
            sim.add(tenant, rng.randint(16, 128), rng.randint(16, 64))
    for _ in range(800):
        sim.step()
        sim.check_accounting()
    assert sim.backlogged() == set(names)
    raw = {t: sim.service[t] * sim.tenants.weight(t) for t in names}  # unweighted tokens of service
    for tenant, weight in zip(names, weights):
        share, expected = raw[tenant] / sum(raw.values()), weight / sum(weights)
        assert abs(share / expected - 1) <= 0.05, (tenant, share, expected)


def test_a_tenant_back_from_idle_does_not_bank_its_idle_time():
    """Tenant b is idle while a runs alone for a long time; when b returns, its counter is
    lifted to a's, so it shares the engine from then on instead of taking it all."""
    sim = Simulation("vtc", {})
    for _ in range(400):
        sim.add("a", 64, 32)
    for _ in range(300):
        sim.step()
    a_before = sim.service["a"]
    for _ in range(200):
        sim.add("b", 64, 32)
    service_at_return = dict(sim.service)
    for _ in range(300):
        sim.step()
    gained = {t: sim.service[t] - service_at_return.get(t, 0.0) for t in ("a", "b")}
    assert a_before > 0 and gained["a"] > 0.8 * gained["b"], gained  # a keeps about half
    assert gained["b"] > 0.8 * gained["a"], gained


def test_light_tenants_first_tokens_come_soon_although_one_tenant_floods():
    """Light tenants send a request now and then while the heavy one keeps 200 queued: under
    VTC their time to first token stays bounded (they wait for a running place or KV blocks that
    a finishing request frees: a few steps here); under FCFS no light request starts at all."""
    def run(policy: str) -> float:
        sim = Simulation(policy, {})
        rng = random.Random(2)
        waits = []
        for tick in range(600):
            while sum(r.tenant == "heavy" for r in sim.unfinished.values()) < 200:
                sim.add("heavy", 128, 64)
            if tick % 20 == 0:
                sim.add("light", rng.randint(16, 64), 16)
            sim.step()
        for request_id, first in sim.first_token.items():
            if request_id.startswith("light"):
                waits.append(first - sim.arrived_at[request_id])
        return max(waits) if len(waits) == 30 else float("inf")  # every light request started

    assert run("vtc") <= 20
    assert run("fcfs") == float("inf")


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_a_light_prompt_goes_before_the_chunks_of_a_heavier_tenants_running_prompt(policy):
    """A heavy tenant's 2,000-token prompt is being prefilled in chunks of the whole budget
    when a light tenant's short prompt arrives. VTC gives the budget to the light prompt first
    (its tenant is less served), so it samples in the step after it arrives; FCFS lets the
    running prompt take the budget until it is done."""
    sim = Simulation(policy, {})
    sim.add("heavy", 2000, 4)
    sim.step()
    sim.add("light", 64, 4)
    while "light-1" not in sim.first_token:
        sim.step()
        sim.check_accounting()
    wait = sim.first_token["light-1"] - sim.arrived_at["light-1"]
    assert wait == (0 if policy == "vtc" else 3), wait
    heavy = sim.unfinished["heavy-0"]
    assert heavy.num_prompt_charged == (512 + 448 if policy == "vtc" else 2000)  # vtc: the rest of the budget


@pytest.mark.parametrize("patience", [0, 8])
def test_a_tenant_kept_out_by_full_places_waits_for_one_that_frees_soon(patience):
    """Every running place is the heavy tenant's, far ahead in service, when a light request
    arrives: with no patience a heavy request is preempted for it at once; with 8 tokens of
    patience, nobody is, while a heavy request ends within 8 steps; its place goes to the light
    request, first in line."""
    sim = Simulation("vtc", {}, bound=64.0, patience=patience)
    for i in range(MAX_SEQS):
        sim.add("heavy", 16, 12 if i == 0 else 400)  # one of them ends early
    while len(sim.scheduler.running) < MAX_SEQS or sim.tick < 4:
        sim.step()
    sim.add("light", 16, 4)
    while "light-16" not in {seq.request_id for seq in sim.last_plan.new}:
        sim.step()
        sim.check_accounting()
        assert sim.tick < 40
    preemptions = sum(n for (cause, _), n in sim.scheduler.preemptions.items() if cause == "fairness")
    assert preemptions == (1 if patience == 0 else 0), sim.scheduler.preemptions
    if patience:
        assert "heavy-0" not in sim.unfinished  # the place it left


def test_a_fairness_victims_blocks_admit_the_waiting_request_in_the_same_step():
    """The heavy tenant holds nearly every KV block when a light tenant's prompt arrives; once
    the heavy tenant is more than the bound ahead, one step swaps a heavy request out and
    starts the light one in its blocks."""
    sim = Simulation("vtc", {}, bound=64.0)
    for _ in range(10):
        sim.add("heavy", 240, 200)  # 15 blocks and growing each: 10 of them fill the 160 blocks
    while sim.blocks.num_free_blocks > 8:
        sim.step()
    sim.add("light", 200, 4)  # 13 blocks
    while "light-10" not in {seq.request_id for seq in sim.last_plan.new}:
        sim.step()
        sim.check_accounting()
        assert sim.tick < 100
    assert sim.last_plan.swap_out and "light-10" in sim.last_plan.request_ids
    assert sim.scheduler.preemptions["fairness", "swap"] == 1, sim.scheduler.preemptions


def test_a_tenant_far_ahead_computes_short_prompt_chunks_while_one_behind_decodes():
    """The steps that a light tenant's tokens wait for stay short: while it decodes, a tenant
    served more than the bound beyond it computes at most the capped prompt tokens a step; with
    nobody behind it decoding, its prompts take the whole budget."""
    sim = Simulation("vtc", {}, capped_prefill=64)
    for _ in range(12):
        sim.add("heavy", MAX_PROMPT, 8)
    heavy_chunks_alone = []
    for _ in range(4):
        sim.step()
        heavy_chunks_alone += [n for n in sim.last_plan.num_scheduled_tokens if n > 1]
    assert max(heavy_chunks_alone) > 64  # alone, nothing caps it
    sim.add("light", 8, 40)
    capped_steps = 0
    for _ in range(40):
        sim.add("heavy", MAX_PROMPT, 8)  # the flood goes on
        counters = sim.policy.counters()  # as the step is planned
        gap = counters["heavy"] - counters.get("light", 0.0)
        sim.step()
        plan = sim.last_plan
        rows = dict(zip(plan.request_ids, plan.num_scheduled_tokens))
        light_decodes = any(rid.startswith("light") and n == 1 for rid, n in rows.items())
        heavy_prompt = sum(n for rid, n in rows.items() if rid.startswith("heavy") and n > 1)
        if light_decodes and gap > 1024.0:
            capped_steps += 1
            assert heavy_prompt <= 64, (sim.tick, rows)
    assert capped_steps >= 10


def test_running_prompts_take_the_budget_least_served_tenant_first():
    """With nothing queued, every running prompt goes before admissions; they take the budget
    least-served tenant first, so the rest of a light tenant's prompt is not held behind a
    flooding tenant's older prompt (in running order it waited until that one was done)."""
    sim = Simulation("vtc", {})
    sim.add("light", 16, 300)  # decodes all along: the light tenant stays active, its counter low
    sim.add("heavy", 2000, 4)
    while "heavy-1" in sim.unfinished:
        sim.step()
    sim.add("heavy", 2000, 4)
    sim.step()  # heavy-2 runs, its prompt in chunks of the budget
    sim.add("light", 1000, 4)
    sim.step()  # light-3 starts with what the budget has left after one decode: 511 tokens
    assert sim.unfinished["light-3"].num_computed_tokens == 511
    sim.step()  # both prompts run; nothing is queued
    assert "light-3" in sim.first_token, sim.last_plan.num_scheduled_tokens
    assert sim.unfinished["heavy-2"].num_computed_tokens < 2000


def test_the_most_served_tenant_leaves_kv_headroom_for_the_tenants_behind_it():
    """The heavy tenant, far ahead, starts requests only while a quarter of the KV blocks stay
    free; a light tenant's prompt then starts in them at once, without a fairness preemption.
    Without the headroom the heavy tenant fills the cache and the light prompt starts by
    swapping a heavy request out."""
    def run(headroom: float) -> tuple[int, int, Simulation]:
        sim = Simulation("vtc", {}, bound=64.0, kv_headroom=headroom)
        sim.add("light", 16, 400)  # active all along, and far behind
        for _ in range(40):
            sim.add("heavy", 200, 24)
        low = NUM_BLOCKS
        for tick in range(40):
            sim.step()
            if tick >= 30:  # the heavy tenant is far ahead by now
                low = min(low, sim.blocks.num_free_blocks)
        sim.add("light", 200, 4)  # 13 blocks
        arrived = sim.tick
        while f"light-{sim.arrivals - 1}" not in sim.first_token:
            sim.step()
            sim.check_accounting()
        return sim.first_token[f"light-{sim.arrivals - 1}"] - arrived, low, sim

    wait, low, sim = run(0.25)
    assert low >= 0.25 * NUM_BLOCKS - 12  # its running requests grow into a few of them
    assert wait == 0 and sim.scheduler.preemptions["fairness", "swap"] == 0, sim.scheduler.preemptions
    _, low_without, sim_without = run(0.0)
    assert low_without < 8 and sim_without.scheduler.preemptions["fairness", "swap"] >= 1

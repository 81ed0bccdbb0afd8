"""Tenants in the engine and the scheduling policy: requests carry their tenant from the offline
API; admission order and preemption victims come from the policy object alone (a test policy
swapped in changes both); a tenant weight changed while the engine runs is used by the next
step."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from loraplex import LLM, SamplingParams
from loraplex.engine.policy import FcfsPolicy, SchedulingPolicy, VtcPolicy
from loraplex.engine.request import Request
from loraplex.engine.tenants import DEFAULT_TENANT
from loraplex.errors import InvalidRequestError


class HeaviestTenantFirst(SchedulingPolicy):
    """Admits the tenant of the largest weight first (arrival order within a tenant) and
    preempts the lightest tenant's newest request. Reads the weights at every call."""

    def __init__(self, tenants) -> None:
        super().__init__(tenants)
        self._queue: list[Request] = []
        self.victims: list[str] = []

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def waiting(self) -> Iterator[Request]:
        return iter(sorted(self._queue, key=lambda r: (-self.tenants.weight(r.tenant), r.arrival)))

    def choose_victim(self, running: Sequence[Request]) -> Request:
        victim = min(running, key=lambda r: (self.tenants.weight(r.tenant), -r.arrival))
        self.victims.append(victim.request_id)
        return victim

    @property
    def num_waiting(self) -> int:
        return len(self._queue)


@pytest.fixture
def llm(tiny_llama):
    model, adapters = tiny_llama
    llm = LLM(model, device="cpu", block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    llm.add_adapter("qv4", adapters["qv4"])
    return llm


def _admission_order(llm: LLM, requests: list[tuple[str, str]]) -> list[str]:
    """Queue (request id, tenant) pairs, then step one request at a time (max_num_seqs 1):
    the order in which they start running."""
    engine = llm.engine
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for request_id, tenant in requests:
        engine.add_request(request_id, prompt_token_ids=[5, 6, 7], params=params, tenant=tenant)
    started = []
    while engine.has_unfinished_requests():
        for request in engine.scheduler.running:
            if request.request_id not in started:
                started.append(request.request_id)
        engine.step()
    return started


def test_offline_requests_carry_their_tenant(llm):
    seen = []
    original = llm.engine.scheduler.add
    llm.engine.scheduler.add = lambda request: seen.append(request.tenant) or original(request)
    llm.generate(prompt_token_ids=[[5], [6], [7]], sampling_params=SamplingParams(max_tokens=1),
                 tenants=["acme", None, "globex"])
    llm.generate(prompt_token_ids=[[5], [6]], sampling_params=SamplingParams(max_tokens=1), tenants="acme")
    assert seen == ["acme", DEFAULT_TENANT, "globex", "acme", "acme"]
    with pytest.raises(InvalidRequestError, match="tenants has 1 entries for 2 prompts"):
        llm.generate(prompt_token_ids=[[5], [6]], tenants=["acme"])


def test_fcfs_ignores_tenants_and_weights(llm):
    assert isinstance(llm.engine.scheduler.policy, VtcPolicy)  # the default
    llm.engine.scheduler.policy = FcfsPolicy(llm.engine.tenants)
    llm.set_tenant_weight("heavy", 8.0)
    order = _admission_order(llm, [("a", "light"), ("b", "heavy"), ("c", "light"), ("d", "heavy")])
    assert order == ["a", "b", "c", "d"]


def test_a_swapped_in_policy_decides_admission_order(llm):
    engine = llm.engine
    engine.scheduler.policy = HeaviestTenantFirst(engine.tenants)
    llm.set_tenant_weight("heavy", 8.0)
    order = _admission_order(llm, [("a", "light"), ("b", "heavy"), ("c", "light"), ("d", "heavy")])
    assert order == ["b", "d", "a", "c"]


def test_a_weight_changed_at_run_time_is_used_by_the_next_step(llm):
    engine = llm.engine
    engine.scheduler.policy = HeaviestTenantFirst(engine.tenants)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for request_id, tenant in [("x1", "x"), ("y1", "y"), ("x2", "x"), ("y2", "y")]:
        engine.add_request(request_id, prompt_token_ids=[5, 6], params=params, tenant=tenant)
    engine.set_tenant_weight("x", 2.0)
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["x1"]
    engine.set_tenant_weight("y", 4.0)  # between two steps: y now outweighs x
    running = engine.scheduler.running
    while not running or running[0].request_id == "x1":
        engine.step()
    assert [r.request_id for r in running] == ["y1"]
    for weight in (0, float("nan"), 1e-300, 1e300, True):
        with pytest.raises(InvalidRequestError, match="weight must be a number from 0.001 to 1000"):
            engine.set_tenant_weight("y", weight)
    assert engine.tenants.weight("y") == 4.0


def test_the_policy_chooses_the_victims(tiny_llama):
    """KV blocks for two of three requests: when they run short, the policy's victim (the
    lightest tenant's newest request) is preempted, not the newest request overall."""
    model, _ = tiny_llama
    llm = LLM(model, device="cpu", block_size=4, num_kv_blocks=7, max_num_batched_tokens=64)
    engine = llm.engine
    policy = HeaviestTenantFirst(engine.tenants)
    engine.scheduler.policy = policy
    llm.set_tenant_weight("heavy", 4.0)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for request_id, tenant in [("light-old", "light"), ("heavy-new", "heavy")]:
        engine.add_request(request_id, prompt_token_ids=[5] * 6, params=params, tenant=tenant)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
    assert policy.victims and set(policy.victims) == {"light-old"}
    assert all(o.finished and len(o.token_ids) == 10 for o in outputs.values())
    alone = llm.generate(prompt_token_ids=[[5] * 6], sampling_params=params)[0]
    assert outputs["light-old"].token_ids == alone.token_ids == outputs["heavy-new"].token_ids


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_a_tenant_waiting_for_a_device_slot_gets_one_by_fair_preemption(tiny_llama, policy):
    """One device slot, held by a heavy tenant's long request when a light tenant's request for
    another adapter arrives: under VTC (past the fairness bound) the heavy request is swapped out,
    which frees the slot, and the light one runs at once; first come, first served lets it wait
    for the slot. Every request gives the tokens it gives alone."""
    model, adapters = tiny_llama
    llm = LLM(model, device="cpu", block_size=4, max_loras=1, max_num_batched_tokens=64,
              scheduling_policy=policy, fairness_bound=8.0)
    for name in ("qv4", "all8"):
        llm.add_adapter(name, adapters[name])
    engine = llm.engine
    params = {"heavy": SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              "light": SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)}
    engine.add_request("heavy", prompt_token_ids=[5, 6, 7], params=params["heavy"], adapter="qv4",
                       tenant="heavy")
    outputs: dict[str, list[int]] = {}
    for _ in range(10):
        for output in engine.step():
            outputs[output.request_id] = output.token_ids
    engine.add_request("light", prompt_token_ids=[8, 9], params=params["light"], adapter="all8",
                       tenant="light")
    finished: list[str] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output.token_ids
            if output.finished:
                finished.append(output.request_id)
    if policy == "vtc":  # the light request ran beside the heavy one's last 30 tokens
        assert engine.scheduler.preemptions[("fairness", "swap")] >= 1, engine.scheduler.preemptions
        assert finished == ["light", "heavy"]
    else:  # it waited for the slot
        assert not engine.scheduler.preemptions
        assert finished == ["heavy", "light"]
    for request_id, adapter, prompt in (("heavy", "qv4", [5, 6, 7]), ("light", "all8", [8, 9])):
        alone = llm.generate(prompt_token_ids=[prompt], sampling_params=params[request_id],
                             adapters=[adapter])[0]
        assert outputs[request_id] == alone.token_ids, request_id
    engine.adapters.settle()
    assert engine.adapters.num_held_slots == 0 and engine.blocks.num_used_blocks == 0


def test_a_swap_out_leaves_on_the_device_only_the_cached_blocks_others_hold_too():
    from loraplex.engine.block_manager import BlockManager

    blocks = BlockManager(16, 4, enable_prefix_caching=True)
    own = blocks.allocate(4)
    blocks.register(own, [b"a", b"b", b"c", b"d"])
    blocks.mark_computed(own)
    assert blocks.num_shared_prefix(own) == 0  # its own prompt: copied to the host when preempted
    other = blocks.match([b"a", b"b", b"x"], 3)  # another request starting with the same two blocks
    assert other == own[:2]
    assert blocks.num_shared_prefix(own) == 2
    blocks.free(other)
    assert blocks.num_shared_prefix(own) == 0

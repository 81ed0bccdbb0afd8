"""The engine's two adapter tiers under churn: many more adapters than device slots and host
room, requests in random order, cold loads on a worker thread. Every output is token-exact
with the same request run alone; nothing leaks (after the run and after aborts in the middle of
loads); the host tier never holds more bytes than its bound; no request waits for its adapter
beyond the stated bound (loraplex/engine/scheduler.py); and a slow load never stalls the
requests already running."""

from __future__ import annotations

import itertools
import random
import threading
import time

import pytest

from loraplex import LLM, SamplingParams
from loraplex.engine.adapter_cache import Wait
from loraplex.engine.lora_weights import adapter_bytes
from tests.engine.pool_checks import assert_pool_accounting
from tests.factories import AdapterSpec, make_adapter, make_hf_model

NUM_ADAPTERS = 64
NUM_REQUESTS = 256
TARGETS = (("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"),
           ("gate_proj", "up_proj", "down_proj"),
           ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


@pytest.fixture(scope="module")
def many_adapters(tmp_path_factory):
    """A tiny Llama and 64 PEFT adapters of ranks 2, 4 and 8 on four target sets."""
    folder = tmp_path_factory.mktemp("churn")
    hf = make_hf_model("llama", folder / "model")
    adapters = {}
    for i in range(NUM_ADAPTERS):
        spec = AdapterSpec(f"a{i}", TARGETS[i % 4], rank=(2, 4, 8)[i % 3], alpha=8)
        adapters[spec.name] = make_adapter(hf, spec, folder / "adapters", seed=100 + i)
    return folder / "model", adapters


def _llm(model, adapters, **options) -> LLM:
    llm = LLM(model, device="cpu", block_size=4, max_lora_rank=8, **options)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return llm


def _requests(adapters) -> list[tuple[str, list[int], str | None, SamplingParams]]:
    rng = random.Random(5)
    names = [None, *adapters]
    requests = []
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 12))]
        params = SamplingParams(max_tokens=rng.randrange(1, 7), temperature=rng.choice([0.0, 0.8]),
                                seed=i, ignore_eos=True)
        requests.append((f"r{i}", prompt, rng.choice(names), params))
    return requests


def _assert_nothing_leaks(llm: LLM) -> None:
    engine = llm.engine
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # the runner forgets finished requests at its next step
    assert_pool_accounting(engine)
    assert engine.blocks.num_used_blocks == 0  # no KV held: every page is free or an adapter's
    assert engine.num_requests == 0 and not engine.runner.batch.row_of
    cache = engine.adapters
    cache.settle()
    assert cache.num_held_slots == 0 and cache.num_needed == 0
    on_host = [cache._host[d] for d in cache.host_digests]
    assert cache.host_bytes == sum(e.adapter.num_bytes for e in on_host)  # the accounting is exact
    assert not cache._loading and not cache._copies


def test_churn_over_64_adapters_4_slots_and_a_host_tier_of_8(many_adapters):
    model, adapters = many_adapters
    requests = _requests(adapters)
    alone = _llm(model, adapters, max_loras=NUM_ADAPTERS, max_cpu_loras=NUM_ADAPTERS)
    expected = {request_id: alone.generate(prompt_token_ids=[prompt], sampling_params=params,
                                           adapters=adapter)[0].token_ids
                for request_id, prompt, adapter, params in requests}

    llm = _llm(model, adapters, max_loras=4, max_cpu_loras=8, max_num_seqs=16, max_num_batched_tokens=32)
    engine, cache = llm.engine, llm.engine.adapters
    # An adapter in the host tier: its tensors and its pool pages (LoraSlotBuffers.prepare)
    bound = 8 * (adapter_bytes(engine.model_config, 8, engine.dtype)
                 + engine.lora.max_adapter_pages * engine.lora.page_bytes)
    assert cache.max_host_bytes == bound
    shuffled = requests[:]
    random.Random(9).shuffle(shuffled)
    adapter_of = {}
    for request_id, prompt, adapter, params in shuffled:
        engine.add_request(request_id, prompt_token_ids=prompt, params=params, adapter=adapter)
        adapter_of[request_id] = engine.local_adapters.resolve(adapter) if adapter else None
    trace = _trace_admissions(engine)
    outputs, max_host_bytes = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.token_ids
        max_host_bytes = max(max_host_bytes, cache.host_bytes)
        assert cache.host_bytes <= bound
    assert outputs == expected
    used = {adapter for _, _, adapter, _ in requests if adapter is not None}
    assert cache.num_slot_loads > len(used)  # adapters went in and out of the four slots
    # Each was read into the host tier once: it stays there while a queued request needs it,
    # so no request's adapter is read twice; room for the next comes as the last user ends.
    assert cache.num_host_loads == len(used)
    print(f"host tier peak {max_host_bytes} of {bound} bytes; {cache.num_host_loads} host loads, "
          f"{cache.num_slot_loads} slot loads; {len(trace.overtakes)} overtakes")
    # The stated bound: a waiting request is overtaken only while its own adapter is being read
    # or copied; waiting for a slot, only by requests for the base model and by those joining a
    # slot but the one kept for it (their adapter's slot: filled before the step, or in it for a
    # request ahead of the waiter); waiting for host room, only by those and by requests whose
    # adapter needed no host load (it was there already).
    for step, waiter, overtaker, ahead in trace.overtakes:
        wait, other = trace.waits[step][waiter], adapter_of[overtaker]
        joins = other != trace.kept[step] and (other in trace.in_slots[step] or other in ahead)
        passed = (wait is Wait.LOADING or other is None or (wait is Wait.NO_SLOT and joins)
                  or (wait is Wait.NO_HOST_ROOM and other in trace.on_host[step]))
        assert passed, f"step {step}: {waiter} ({wait}) overtaken by {overtaker}"
    _assert_nothing_leaks(llm)


class _Trace:
    def __init__(self) -> None:
        self.waits: list[dict[str, Wait]] = []  # per step: request id -> why it waited
        self.on_host: list[set[str]] = []  # per step: digests in host memory or a slot before it
        self.in_slots: list[set[str]] = []  # per step: digests in a slot before it
        self.kept: list[str | None] = []  # per step: the held slot kept for a request waiting for one
        # (step, overtaken, overtaker, the adapters of the requests ahead of the overtaken)
        self.overtakes: list[tuple[int, str, str, set[str]]] = []


def _trace_admissions(engine) -> _Trace:
    """Record, at every step, why requests waited and who was admitted ahead of whom."""
    trace = _Trace()
    scheduler, cache = engine.scheduler, engine.adapters
    schedule = scheduler.schedule

    def traced_schedule():
        trace.on_host.append(set(cache.host_digests) | set(cache.resident))
        trace.in_slots.append(set(cache.resident))
        order = [r for r in scheduler.policy.waiting() if not r.num_pending]
        plan = schedule()
        trace.waits.append(dict(scheduler.adapter_waits))
        trace.kept.append(scheduler.kept_slot)
        admitted = {seq.request_id for seq in plan.new}
        step = len(trace.waits) - 1
        for index, request in enumerate(order):
            if request.request_id in admitted:
                trace.overtakes += [(step, waiter.request_id, request.request_id,
                                     {r.adapter for r in order[:place]})
                                    for place, waiter in enumerate(order[:index])
                                    if waiter.request_id not in admitted]
        return plan

    scheduler.schedule = traced_schedule
    return trace


def test_a_request_waiting_for_a_slot_is_not_overtaken_by_its_holders(many_adapters):
    """One slot, held by a long request for adapter a0; a request for a1 (in host memory)
    waits for it. New requests for a0 keep arriving, and a0 is in the slot: none of them is
    admitted before the one for a1."""
    model, adapters = many_adapters
    llm = _llm(model, {"a0": adapters["a0"], "a1": adapters["a1"]}, max_loras=1)
    engine = llm.engine
    long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=[[5]], adapters="a1", sampling_params=short)  # a1 in host memory
    engine.add_request("holder", prompt_token_ids=[5, 6], params=long, adapter="a0")
    while not engine.scheduler.running:
        engine.step()
    engine.add_request("cold", prompt_token_ids=[7, 8], params=short, adapter="a1")
    started: list[str] = []
    deadline = time.monotonic() + 30
    for i in itertools.count():
        if i < 40:
            engine.add_request(f"hot{i}", prompt_token_ids=[9], params=short, adapter="a0")
        engine.step()
        started += [r.request_id for r in engine.scheduler.running if r.request_id not in started]
        if "cold" in started:
            break
        assert engine.scheduler.adapter_waits["cold"] in (Wait.NO_SLOT, Wait.LOADING)
        assert time.monotonic() < deadline, "the request for a1 never got the slot"
    assert [r for r in started if r.startswith("hot")] == []  # no hot request went first
    _assert_nothing_leaks(llm)


def test_a_request_waiting_for_a_slot_lets_others_join_every_slot_but_the_one_kept_for_it(many_adapters):
    """Two slots, held by a long request for a0 and a short one for a1; a request for a2 (in
    host memory) waits for a slot. The slot kept for it is a1's (its holder ends first): new
    requests for a0 join a0's slot meanwhile, those for a1 wait; the request for a2 takes a1's
    slot when its holder ends. Every output is token-exact with the request run alone."""
    model, adapters = many_adapters
    used = {name: adapters[name] for name in ("a0", "a1", "a2")}
    alone = _llm(model, used, max_loras=3)
    llm = _llm(model, used, max_loras=2)
    engine = llm.engine
    long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=[[5]], adapters="a2", sampling_params=short)  # a2 in host memory
    requests = {"long": ([5, 6], "a0", long), "short": ([6, 7], "a1", short)}
    for request_id, (prompt, adapter, params) in requests.items():
        engine.add_request(request_id, prompt_token_ids=prompt, params=params, adapter=adapter)
    while len(engine.scheduler.running) < 2:
        engine.step()
    requests["cold"] = ([7, 8], "a2", short)
    engine.add_request("cold", prompt_token_ids=[7, 8], params=short, adapter="a2")
    a0, a1 = (engine.local_adapters.resolve(name) for name in ("a0", "a1"))
    started, outputs = [], {}
    for i in itertools.count():
        if i < 3:
            for adapter in ("a0", "a1"):
                request_id = f"join-{adapter}-{i}"
                requests[request_id] = ([9, i + 3], adapter, short)
                engine.add_request(request_id, prompt_token_ids=[9, i + 3], params=short, adapter=adapter)
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.token_ids
        started += [r.request_id for r in engine.scheduler.running if r.request_id not in started]
        if "cold" in started:
            break
        wait = engine.scheduler.adapter_waits["cold"]
        assert wait is Wait.LOADING or (wait is Wait.NO_SLOT and engine.scheduler.kept_slot == a1)
        assert engine.adapters.slot_of(a0) is not None
        assert i < 40, "the request for a2 never got a slot"
    joined = [r for r in started if r.startswith("join")]
    assert joined and all(r.startswith("join-a0") for r in joined)  # a0's joined, a1's waited
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.token_ids
    assert outputs.keys() == requests.keys()
    for request_id, (prompt, adapter, params) in requests.items():
        expected = alone.generate(prompt_token_ids=[prompt], adapters=adapter, sampling_params=params)
        assert outputs[request_id] == expected[0].token_ids, request_id
    _assert_nothing_leaks(llm)


def test_aborts_in_the_middle_of_loads_leak_nothing(many_adapters):
    model, adapters = many_adapters
    llm = _llm(model, adapters, max_loras=4, max_cpu_loras=8)
    engine = llm.engine
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for i in range(24):
        engine.add_request(f"r{i}", prompt_token_ids=[5, 6, 7], params=params, adapter=f"a{i}")
    engine.step()  # host loads and slot copies start
    for i in range(0, 24, 2):
        engine.abort(f"r{i}")
    engine.step()
    for i in range(1, 24, 4):
        engine.abort(f"r{i}")
    _assert_nothing_leaks(llm)
    out = llm.generate(prompt_token_ids=[[5, 6]], adapters="a3", sampling_params=params)
    assert len(out[0].token_ids) == 3
    _assert_nothing_leaks(llm)


def test_a_slow_load_does_not_stall_running_requests(many_adapters):
    """A loader that holds one adapter's load until the test lets it go: the requests already
    running keep producing tokens meanwhile (steps never wait for the load), and the request for
    it runs once loaded. (It once counted tokens over a 2 s sleep, and failed on a loaded machine
    where steps took longer than it allowed.)"""
    model, adapters = many_adapters
    llm = _llm(model, adapters, max_loras=4)
    engine = llm.engine
    slow = engine.local_adapters.resolve("a7")
    loading, release = threading.Event(), threading.Event()
    load = engine.local_adapters.load

    def slow_loader(digest):
        if digest == slow:
            loading.set()
            assert release.wait(timeout=120), "the test never let the load go"
        return load(digest)

    engine.adapters.set_loader(slow_loader)
    running = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i, adapter in enumerate([None, "a1", "a2"]):
        engine.add_request(f"busy{i}", prompt_token_ids=[5 + i] * 3, params=running, adapter=adapter)
    while len(engine.scheduler.running) < 3:
        engine.step()
    engine.add_request("cold", prompt_token_ids=[9, 9], adapter="a7",
                       params=SamplingParams(max_tokens=2, ignore_eos=True))
    tokens_during_load = 0
    try:
        while tokens_during_load < 3 * 20:  # steps go on while the load is held
            outputs = engine.step()
            tokens_during_load += sum(len(o.new_token_ids) for o in outputs
                                      if o.request_id.startswith("busy"))
            assert "cold" not in {r.request_id for r in engine.scheduler.running}
        assert loading.is_set()  # the load had started: the steps did not wait for it
    finally:
        release.set()
    while "cold" not in {r.request_id for r in engine.scheduler.running}:
        engine.step()
    for request_id in ("busy0", "busy1", "busy2"):
        engine.abort(request_id)
    _assert_nothing_leaks(llm)


def test_no_fairness_preemption_is_made_for_a_request_whose_adapter_is_still_loading(many_adapters):
    """Every running place is taken by a heavy tenant, far past the fairness bound, when a light
    tenant's request arrives whose adapter's load is held: preempting for it would free a place
    it cannot use (issue 27's cold bursts paid hundreds of such preemptions). None is made while
    the load is held; once the adapter is in host memory the heavy request is preempted and the
    light one runs."""
    model, adapters = many_adapters
    llm = _llm(model, adapters, max_loras=4, max_num_seqs=1, fairness_bound=8.0)
    engine = llm.engine
    slow = engine.local_adapters.resolve("a7")
    release = threading.Event()
    load = engine.local_adapters.load

    def slow_loader(digest):
        if digest == slow:
            assert release.wait(timeout=120), "the test never let the load go"
        return load(digest)

    engine.adapters.set_loader(slow_loader)
    engine.add_request("heavy", prompt_token_ids=[5, 6, 7], adapter="a1", tenant="heavy",
                       params=SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True))
    for _ in range(20):
        engine.step()
    engine.add_request("light", prompt_token_ids=[9, 9], adapter="a7", tenant="light",
                       params=SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    try:
        for _ in range(30):
            engine.step()
            assert not engine.scheduler.preemptions, engine.scheduler.preemptions
    finally:
        release.set()
    for _ in range(200):
        engine.step()
        if "light" in {r.request_id for r in engine.scheduler.running}:
            break
    assert "light" in {r.request_id for r in engine.scheduler.running}
    assert engine.scheduler.preemptions[("fairness", "swap")] >= 1, engine.scheduler.preemptions
    _assert_nothing_leaks(llm)


def test_requests_queued_for_a_resident_adapter_load_nothing_into_the_host_tier(many_adapters):
    """A host tier of one adapter, and running places for one request: the requests queued
    behind it for adapters already resident on the device make no host load (prefetching
    them read them into the host tier again, evicting what the others needed)."""
    model, adapters = many_adapters
    names = ["a0", "a1", "a2"]
    llm = _llm(model, {name: adapters[name] for name in names}, max_num_seqs=1, max_cpu_loras=1)
    engine, params = llm.engine, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i, name in enumerate(names):  # each loaded once, and left resident
        llm.generate(prompt_token_ids=[[5, 6, 7 + i]], sampling_params=params, adapters=[name])
    assert set(engine.adapters.resident) == {engine.adapter_digest(n) for n in names}
    loads = engine.adapters.num_host_loads
    for i in range(6):
        engine.add_request(f"q{i}", prompt_token_ids=[9, 10 + i], params=params, adapter=names[i % 3])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.adapters.num_host_loads == loads
    _assert_nothing_leaks(llm)

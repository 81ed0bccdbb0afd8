"""The step-level engine: requests join and leave at every step, and every KV block and
adapter slot comes back when a request finishes, fails or is aborted, with steps run one at a
time or overlapped (async scheduling)."""

from __future__ import annotations

import threading
import time

import pytest

from loraplex import LLM, SamplingParams
from loraplex.errors import InvalidRequestError, UnknownAdapterError


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def llm(tiny_llama, request):
    model, adapters = tiny_llama
    llm = LLM(model, device="cpu", block_size=4, max_num_batched_tokens=16, max_loras=2,
              async_scheduling=request.param)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return llm


def _assert_all_returned(engine):
    engine.step()  # the runner drops finished requests' rows at its next step
    assert not engine.has_unfinished_requests()
    assert engine.blocks.num_used_blocks == 0
    assert engine.scheduler.num_unfinished == 0
    assert engine.num_requests == 0
    assert not engine.runner.batch.row_of
    engine.adapters.settle()  # a copy into a slot for an aborted request ends on its own
    assert engine.adapters.num_held_slots == 0 and engine.adapters.num_needed == 0


def _step_until(engine, condition, max_seconds: float = 30.0):
    deadline = time.monotonic() + max_seconds
    while not condition():
        assert time.monotonic() < deadline, "the engine did not get there"
        engine.step()


def test_requests_join_and_leave_at_every_step(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    engine.add_request("a", prompt_token_ids=[5] * 30, adapter="all8",
                       params=SamplingParams(max_tokens=10, ignore_eos=True))
    engine.step()  # a: first chunk of its prompt
    engine.add_request("b", prompt_token_ids=[7, 8], params=params)
    seen, finished_at = set(), {}
    for step in range(40):
        for out in engine.step():
            seen.add(out.request_id)
            if out.finished:
                finished_at[out.request_id] = step
        if step == 2:
            engine.add_request("c", prompt_token_ids=[9], params=SamplingParams(max_tokens=2),
                               adapter="qv4")
        if not engine.has_unfinished_requests():
            break
    assert seen == {"a", "b", "c"}
    assert finished_at["c"] < finished_at["a"]  # joined later, left earlier
    _assert_all_returned(engine)


def test_abort_returns_blocks_and_slots(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    for i, adapter in enumerate(["qv4", "all8", None, "mlp16"]):
        engine.add_request(f"r{i}", prompt_token_ids=[3 + i] * (5 + 7 * i), params=params, adapter=adapter)
    for _ in range(4):
        engine.step()
    assert engine.blocks.num_used_blocks > 0
    assert engine.abort("r0") and engine.abort("r3") and engine.abort("r2") and engine.abort("r1")
    assert not engine.abort("r1")  # already gone
    engine.step()  # the runner forgets them
    _assert_all_returned(engine)


def test_request_aborted_mid_copy_leaves_the_slot_filling_until_the_copy_ends(llm, monkeypatch):
    """The copy into a slot runs on its own thread: an abort does not cut it short, the slot
    counts as held until the copy ends, and then nothing is held (settle waits for that)."""
    engine, cache = llm.engine, llm.engine.adapters
    gate = threading.Event()
    load = cache.buffers.load

    def slow_load(*args):
        assert gate.wait(30), "the test never opened the gate"
        return load(*args)

    monkeypatch.setattr(cache.buffers, "load", slow_load)
    engine.add_request("r", prompt_token_ids=[5, 6, 7], adapter="all8",
                       params=SamplingParams(max_tokens=4, ignore_eos=True))
    _step_until(engine, lambda: cache._copies)
    assert engine.abort("r")
    engine.step()
    engine.step()
    assert not engine.has_unfinished_requests() and cache.num_needed == 0
    assert cache.num_held_slots == 1  # the copy is still under way
    gate.set()
    cache.settle()
    _assert_all_returned(engine)
    assert cache.slot_of(engine.local_adapters.resolve("all8")) is not None  # resident, idle


def test_failed_step_fails_its_requests_and_frees_everything(llm, monkeypatch):
    engine = llm.engine
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", prompt_token_ids=[4, 5, 6], params=params, adapter="pattern")
    _step_until(engine, lambda: len(engine.scheduler.running) == 3)  # the adapter loads first
    model = engine.runner.model

    def broken(*args, **kwargs):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(model, "forward", broken)
    outputs = engine.step()
    assert {o.request_id for o in outputs} == {"r0", "r1", "r2"}
    assert all(o.finished and o.finish_reason == "error" and "device fell over" in o.error for o in outputs)
    monkeypatch.undo()
    engine.step()
    _assert_all_returned(engine)
    # The engine keeps serving after a failed step.
    out = llm.generate(prompt_token_ids=[[4, 5, 6]], sampling_params=SamplingParams(max_tokens=3))
    assert len(out[0].token_ids) == 3
    _assert_all_returned(engine)


def test_bad_requests_are_refused_without_leaking(llm):
    engine = llm.engine
    with pytest.raises(UnknownAdapterError, match="adapter 'nope' is not loaded"):
        llm.generate(prompt_token_ids=[[5, 6], [7, 8]], adapters=[None, "nope"])
    with pytest.raises(InvalidRequestError, match="prompt token ids must be integers in"):
        llm.generate(prompt_token_ids=[[5, 100000]])
    with pytest.raises(InvalidRequestError, match="the prompt is empty"):
        llm.generate(prompt_token_ids=[[]])
    with pytest.raises(InvalidRequestError, match="max_tokens must be an integer >= 0"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(InvalidRequestError, match="top_p must be in"):
        SamplingParams(top_p=0.0)
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidRequestError, match="sampling_params has 1 entries for 2 prompts"):
        llm.generate(prompt_token_ids=[[5], [6]], sampling_params=[SamplingParams()])
    engine.step()
    _assert_all_returned(engine)


def test_removed_adapter_frees_its_slot_and_name(llm):
    out = llm.generate(prompt_token_ids=[[5, 6]], adapters="qv4",
                       sampling_params=SamplingParams(max_tokens=2))
    assert out[0].adapter == "qv4"
    digest = llm.engine.local_adapters.resolve("qv4")
    assert llm.engine.adapters.slot_of(digest) is not None
    llm.remove_adapter("qv4")
    assert llm.engine.adapters.slot_of(digest) is None
    with pytest.raises(UnknownAdapterError):
        llm.generate(prompt_token_ids=[[5, 6]], adapters="qv4")


def test_same_adapter_under_two_names_shares_one_slot(llm, tiny_llama):
    _, adapters = tiny_llama
    digest = llm.add_adapter("alias", adapters["all8"])
    assert digest == llm.engine.local_adapters.resolve("all8")
    outs = llm.generate(prompt_token_ids=[[5, 6, 7]] * 2, adapters=["all8", "alias"],
                        sampling_params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert outs[0].token_ids == outs[1].token_ids
    assert len(llm.engine.adapters.resident) == 1


def test_adapter_removed_while_in_use_is_freed_when_its_last_request_ends(llm):
    engine = llm.engine
    engine.add_request("r", prompt_token_ids=[5, 6], adapter="mlp16",
                       params=SamplingParams(max_tokens=4, ignore_eos=True))
    _step_until(engine, lambda: engine.scheduler.running)
    digest = engine.local_adapters.resolve("mlp16")
    llm.remove_adapter("mlp16")
    assert engine.adapters.slot_of(digest) is not None  # the running request still uses it
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 4
    assert engine.adapters.slot_of(digest) is None
    assert digest not in engine.adapters.host_digests
    _assert_all_returned(engine)


def test_top_k_beyond_any_vocabulary_means_no_filter(llm):
    params = SamplingParams(max_tokens=3, temperature=0.7, top_k=10**12, seed=1, ignore_eos=True)
    unfiltered = SamplingParams(max_tokens=3, temperature=0.7, seed=1, ignore_eos=True)
    a = llm.generate(prompt_token_ids=[[5, 6]], sampling_params=params)[0].token_ids
    b = llm.generate(prompt_token_ids=[[5, 6]], sampling_params=unfiltered)[0].token_ids
    assert a == b

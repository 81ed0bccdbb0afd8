"""Preemption by swapping KV to the host pool, on CPU in float32: a request swapped out and in
several times (at block boundaries, mid-block, during chunked prefill; with async scheduling on
and off) gives exactly the tokens it gives with no preemption, and those of transformers + PEFT;
a second swap-out copies only what was written since; aborts during swaps leak nothing; the host
pool's accounting is exact; a full pool falls back to recompute and says so."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine.kv_swap import runs
from loraplex.engine.request import RequestStatus
from loraplex.engine.scheduler import Scheduler
from tests.engine.test_hf_parity import MAX_TOKENS, _hf_references
from tests.factories import make_adapters, make_hf_model

BLOCK_SIZE = 8
NUM_TOKENS = 24
PROMPTS = {"long": 45, "mid": 19, "short": 6}
NAMES = {"long": "qv4", "mid": "all8", "short": None}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    folder = tmp_path_factory.mktemp("swap")
    hf = make_hf_model("llama", folder / "model")
    adapters = make_adapters(hf, folder / "adapters")
    generator = torch.Generator().manual_seed(3)
    prompts = {k: torch.randint(3, 300, (n,), generator=generator).tolist() for k, n in PROMPTS.items()}
    references = _hf_references(hf, adapters, list(prompts.values()), list(NAMES.values()))
    hf_tokens = {k: tokens for k, (tokens, _) in zip(prompts, references)}
    return folder / "model", adapters, prompts, hf_tokens


def _llm(case, **options) -> LLM:
    model_dir, adapters, _, _ = case
    llm = LLM(model_dir, device="cpu", dtype="float32", block_size=BLOCK_SIZE, **options)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return llm


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


def _alone(case) -> dict[str, list[int]]:
    _, _, prompts, _ = case
    llm = _llm(case, swap_space=0)
    return {k: llm.generate(prompt_token_ids=[p], sampling_params=_params(), adapters=[NAMES[k]])[0].token_ids
            for k, p in prompts.items()}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_request_swapped_many_times_gives_the_tokens_it_gives_alone(case, async_scheduling, monkeypatch):
    _, _, prompts, hf_tokens = case
    states = []  # (tokens computed, whether its prompt was done) at each swap-out
    swap_out = Scheduler._swap_out

    def recording(self, request, plan):
        states.append((request.num_computed_tokens, request.num_computed_tokens >= request.num_prompt_tokens))
        return swap_out(self, request, plan)

    monkeypatch.setattr(Scheduler, "_swap_out", recording)
    llm = _llm(case, max_num_batched_tokens=20, async_scheduling=async_scheduling)
    engine = llm.engine
    for key, prompt in prompts.items():
        engine.add_request(key, prompt_token_ids=prompt, params=_params(), adapter=NAMES[key])
    outputs, steps_run = {}, {"long": 0, "mid": 0}
    while engine.has_unfinished_requests():
        for key in steps_run:  # preempt each after its 1st, 5th, 9th... step of running
            request = engine._requests.get(key)
            if request is not None and request.status is RequestStatus.RUNNING:
                steps_run[key] += 1
                if steps_run[key] % 4 == 1:
                    engine.preempt(key)
        for output in engine.step():
            outputs[output.request_id] = output
    expected = _alone(case)
    for key in prompts:
        assert outputs[key].token_ids == expected[key], key
        assert outputs[key].token_ids[:MAX_TOKENS] == hf_tokens[key], key
    computed = [n for n, _ in states]
    assert any(n % BLOCK_SIZE == 0 for n in computed), computed  # at a block boundary
    assert any(n % BLOCK_SIZE for n in computed), computed  # mid-block
    assert any(not prompt_done for _, prompt_done in states), states  # during chunked prefill
    scheduler = engine.scheduler
    assert scheduler.preemptions == {("asked", "swap"): len(states)}
    # The host copy outlives each swap-in: the blocks copied out are fewer than a full copy
    # each time, and every block copied out came back.
    full_copies = sum(-(-n // BLOCK_SIZE) for n in computed)
    assert scheduler.num_blocks_swapped_out < full_copies
    swaps = engine.runner.swapper.stats()
    block_bytes = engine.runner.swapper.block_bytes
    assert swaps.bytes_out == scheduler.num_blocks_swapped_out * block_bytes
    assert swaps.bytes_in == scheduler.num_blocks_swapped_in * block_bytes
    # On CPU the copies hold up the steps: the stall is the copies' own time, and no more.
    assert swaps.seconds_stalled > 0
    assert swaps.seconds_stalled >= swaps.seconds_out + swaps.seconds_in - 1e-6
    assert scheduler.host_blocks.num_used_blocks == 0
    assert engine.blocks.num_used_blocks == 0


def test_kv_pressure_swaps_and_aborts_during_swaps_leak_nothing(case):
    """Too few KV blocks for everything at once: requests are swapped out for others and back.
    Some are aborted while swapped out, some right after being admitted to swap in (their copy
    queued, not yet read). Nothing leaks; the pool's accounting is exact at every step."""
    _, _, prompts, _ = case
    llm = _llm(case, num_kv_blocks=14, max_num_batched_tokens=32)
    engine = llm.engine
    keys = [f"{k}-{i}" for i in range(4) for k in prompts]
    for key in keys:
        base = key.split("-")[0]
        engine.add_request(key, prompt_token_ids=prompts[base], params=_params(), adapter=NAMES[base])
    scheduler, host = engine.scheduler, engine.scheduler.host_blocks
    aborted, outputs = set(), {}
    while engine.has_unfinished_requests():
        requests = list(engine._requests.values())
        assert host.num_used_blocks == sum(len(r.host_block_ids) for r in requests)
        swapped = [r for r in requests if r.is_swapped]
        if swapped and len(aborted) < 2:
            aborted.add(swapped[0].request_id)
            engine.abort(swapped[0].request_id)
        for output in engine.step():
            outputs[output.request_id] = output
        swapping_in = {r for r in scheduler.running if r.num_host_tokens and r.request_id not in aborted}
        if swapping_in and len(aborted) in (2, 3):
            victim = next(iter(swapping_in)).request_id
            aborted.add(victim)
            engine.abort(victim)
    engine.step()
    assert len(aborted) == 4, aborted
    assert sum(n for (cause, mode), n in scheduler.preemptions.items() if mode == "swap") >= 4
    assert engine.blocks.num_used_blocks == 0
    assert host.num_used_blocks == 0 and not engine.runner.batch.row_of
    engine.adapters.settle()  # a copy into a slot for an aborted request ends on its own
    assert engine.adapters.num_held_slots == 0 and engine.adapters.num_needed == 0
    expected = _alone(case)
    for key, output in outputs.items():
        if key not in aborted:
            assert output.token_ids == expected[key.split("-")[0]], key


def test_a_full_host_pool_falls_back_to_recompute(case):
    _, _, prompts, _ = case
    block_bytes = _llm(case, num_kv_blocks=14).engine.runner.swapper.block_bytes
    llm = _llm(case, num_kv_blocks=14, max_num_batched_tokens=32, swap_space=3 * block_bytes / 2**30)
    engine = llm.engine
    assert engine.scheduler.host_blocks.num_blocks == 3
    outputs = {}
    for key in [f"{k}-{i}" for i in range(3) for k in prompts]:
        base = key.split("-")[0]
        engine.add_request(key, prompt_token_ids=prompts[base], params=_params(), adapter=NAMES[base])
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
    modes = {mode for _, mode in engine.scheduler.preemptions}
    assert modes == {"swap", "recompute"}, engine.scheduler.preemptions
    stats = engine.stats()
    assert any(k.endswith(":recompute") for k in stats.preemptions)
    expected = _alone(case)
    assert all(o.token_ids == expected[k.split("-")[0]] for k, o in outputs.items())


def test_copies_are_coalesced_into_runs():
    assert runs([(3, 10), (4, 11), (5, 12), (9, 13), (10, 14), (2, 0)]) == [(3, 10, 3), (9, 13, 2), (2, 0, 1)]
    assert runs([]) == []

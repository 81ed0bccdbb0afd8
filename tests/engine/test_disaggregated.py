"""Disaggregated prefill and decode, float32 on CPU: a prefill engine computes each prompt and
first token under its adapter, a decode engine on its own KV pool continues from its blocks,
copied in one process or, with worker processes (`processes`), sent between the two sides'
workers over gloo. Against the colocated engine on the same weights: greedy and seeded
outputs token-exact for mixed adapters of every family (LoRA, DoRA, IA3, FLoRA), with pinned
system prompts (pinned on both sides, never sent again nor computed on the decode side), aborts
while requests are between the sides, and a decode side whose KV runs out (it preempts: swap
and recompute). After every run no block is held on either side but the pinned ones."""

from __future__ import annotations

import os
import re

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine.disaggregated import DisaggregatedEngine, copy_kv_blocks
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine_config import ConfigError, EngineConfig
from loraplex.types import StructuredOutput
from tests.engine.test_adapter_families import _make_adapters
from tests.factories import make_hf_model

BLOCK_SIZE = 4
MAX_TOKENS = 8
PROMPT_LENGTHS = (5, 1, 17, 9, 3, 12, 7, 20, 2, 11, 6, 16)
NAMES = (None, "lora16", "dora1-attn", "dora16-all", "ia3-attn", "ia3-all", "flora1-attn",
         "flora4-all", "flora16-attn", "lora2", None, "ia3-default")
TENANTS = ("acme", "globex", "initech")
OPTIONS = dict(block_size=BLOCK_SIZE, max_num_batched_tokens=16, max_num_seqs=16)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    folder = tmp_path_factory.mktemp("disaggregated")
    hf = make_hf_model("llama", folder / "model")
    adapters = _make_adapters(hf, folder / "adapters")
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    return folder / "model", adapters, prompts


def _config(model_dir, **options) -> EngineConfig:
    return EngineConfig.from_kwargs(str(model_dir), device="cpu", dtype="float32", **{**OPTIONS, **options})


def _with_adapters(engine, adapters):
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    return engine


def _colocated(case, **options) -> LLMEngine:
    model_dir, adapters, _ = case
    return _with_adapters(LLMEngine(_config(model_dir, **options)), adapters)


@pytest.fixture
def closing():
    """Engines to close after the test (worker processes stop with them)."""
    engines = []
    yield engines
    for engine in engines:
        engine.close()


def _disaggregated(case, decode_options=None, processes=False, closing=None, concurrent=False,
                   staging_blocks=None, **options) -> DisaggregatedEngine:
    model_dir, adapters, _ = case
    decode = _config(model_dir, **{**options, **(decode_options or {})})
    engine = DisaggregatedEngine(_config(model_dir, **options), decode, processes=processes,
                                 concurrent=concurrent, staging_blocks=staging_blocks)
    if closing is not None:
        closing.append(engine)
    return _with_adapters(engine, adapters)


WITH_WORKERS = pytest.param(True, id="workers")
"""The same test with each side's model in a worker process of its own (the prefill side's
worker pushing each request's blocks into the decode side's staging area)."""


def _greedy(max_tokens=MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _add_all(engine, prompts, params, names=NAMES):
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        engine.add_request(f"r{i}", prompt_token_ids=prompt, adapter=name, tenant=TENANTS[i % len(TENANTS)],
                           params=params[i] if isinstance(params, list) else params)


def _run(engine, on_step=None) -> dict[str, list[int]]:
    """Step to the end; each finished request's tokens (`on_step(engine)` before each step)."""
    outputs = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        if on_step is not None:
            on_step(engine)
        for output in engine.step():
            assert output.error is None, output.error
            if output.finished:
                outputs[output.request_id] = output.token_ids
    else:
        raise AssertionError("the engine never finished")
    return outputs


def _assert_nothing_held(engine: DisaggregatedEngine, pinned_blocks: int = 0) -> None:
    assert engine.prefill.blocks.num_used_blocks == pinned_blocks
    assert engine.decode.blocks.num_used_blocks == pinned_blocks
    assert engine.prefill.num_requests == engine.decode.num_requests == 0
    assert not engine._transit and not engine._handed_over and not engine._prefill_outputs
    assert not engine._pushing and not engine._pushed and not engine._staged
    assert engine._staging.num_free_blocks == engine._staging.num_blocks
    for side in (engine.prefill, engine.decode):
        host = side.scheduler.host_blocks
        assert host is None or host.num_used_blocks == 0
        assert not side.scheduler.running and side.scheduler.num_waiting == 0


@pytest.mark.parametrize(("async_scheduling", "processes", "concurrent", "staging_blocks"),
                         [(False, False, False, None), (True, False, False, None), (False, True, False, None),
                          (True, False, True, None), (True, True, True, None), (True, True, True, 6)],
                         ids=["sync", "async", "workers", "concurrent", "workers-concurrent",
                              "workers-small-staging"])
def test_greedy_outputs_match_the_colocated_engine_for_every_family(case, async_scheduling, processes,
                                                                    concurrent, staging_blocks, closing):
    """`concurrent`: the prefill side steps on a thread of its own. With worker processes the
    prefill side's worker pushes each request's blocks into the decode side's staging area, or,
    where it has no room (6 blocks: one or two prompts at a time), the decode side's worker
    copies them out of the prefill side's cache."""
    _, _, prompts = case
    colocated = _colocated(case, async_scheduling=async_scheduling)
    _add_all(colocated, prompts, _greedy())
    expected = _run(colocated)
    engine = _disaggregated(case, async_scheduling=async_scheduling, processes=processes, closing=closing,
                            concurrent=concurrent, staging_blocks=staging_blocks)
    assert engine.is_concurrent == concurrent
    if processes:  # one worker process a side, neither this one
        pids = engine.prefill.executor.workers.pids + engine.decode.executor.workers.pids
        assert len(set(pids)) == 2 and os.getpid() not in pids
    charges = []  # (tenant, prompt tokens, output tokens) the decode side's VTC counted
    policy = engine.decode.scheduler.policy
    charge = policy.charge

    def recording(request, prompt_tokens, output_tokens):
        charges.append((request.tenant, prompt_tokens, output_tokens))
        charge(request, prompt_tokens, output_tokens)

    policy.charge = recording
    _add_all(engine, prompts, _greedy())
    assert _run(engine) == expected
    # Every prompt block crossed once; the decode side computed no prompt token.
    assert engine.num_blocks_sent == sum(-(-len(p) // BLOCK_SIZE) for p in prompts)
    if not processes:
        assert engine.num_blocks_staged == 0
    elif staging_blocks is None:  # room for every prompt: all pushed
        assert engine.num_blocks_staged == engine.num_blocks_sent
    else:
        assert 0 < engine.num_blocks_staged < engine.num_blocks_sent
    transfers = engine.transfers
    assert transfers.num_transfers == len(prompts) and transfers.num_blocks == engine.num_blocks_sent
    assert transfers.num_bytes == engine.num_blocks_sent * engine.decode.memory.kv_block_bytes
    assert transfers.durations.count == len(prompts)
    assert transfers.seconds > 0 and transfers.bytes_per_second > 0
    assert engine.decode.num_prompt_tokens == 0
    assert engine.prefill.num_generated_tokens == len(prompts)
    assert engine.decode.num_generated_tokens == len(prompts) * (MAX_TOKENS - 1)
    # Both sides served every family; the decode side's VTC counted each tenant's outputs, and
    # no prompt token (charged once, on the prefill side).
    for side in (engine.prefill, engine.decode):
        if processes:  # (the slots are the workers'; each named adapter went into one)
            assert side.adapters.num_slot_loads >= len(set(NAMES) - {None})
            # laid out as the worker's pool pages here, in shared memory (RemoteSlots.prepare)
            hosts = [e.adapter for e in side.adapters._host.values() if e.adapter is not None]
            assert hosts and all(p.pages.is_shared() for h in hosts for p in h.packed.values())
            assert all(h.packed for h in hosts)
            # their pages written into the worker's adapter ring, which every load gave back
            slots = side.executor.slots
            assert slots.num_ring_loads > 0 and slots.ring_free_bytes == slots._ring.numel()
        else:
            families = {side.lora.slot_family[slot] for slot in range(1, side.lora.num_slots + 1)}
            assert families >= {"lora", "dora", "ia3", "flora"}
    assert all(prompt == 0 for _, prompt, _ in charges)
    for t, tenant in enumerate(TENANTS):
        num_requests = len(range(t, len(prompts), len(TENANTS)))
        assert sum(output for who, _, output in charges if who == tenant) == num_requests * (MAX_TOKENS - 1)
    assert set(engine.decode.scheduler.policy.counters()) == set(TENANTS)
    _assert_nothing_held(engine)


def test_seeded_sampling_matches_the_colocated_engine(case):
    """Sampling noise depends on (seed, token index): the decode side draws what the colocated
    engine draws, for requests with their own seed and with one drawn at arrival."""
    _, _, prompts = case
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, ignore_eos=True,
                             seed=1000 + i if i % 2 else None) for i in range(len(prompts))]
    colocated = _colocated(case, seed=3)
    _add_all(colocated, prompts, params)
    expected = _run(colocated)
    engine = _disaggregated(case, seed=3)
    _add_all(engine, prompts, params)
    assert _run(engine) == expected
    assert len({tuple(tokens) for tokens in expected.values()}) == len(prompts)
    _assert_nothing_held(engine)


def test_the_offline_llm_runs_disaggregated(case):
    model_dir, adapters, prompts = case
    outputs = {}
    for disaggregate in (None, "1:1"):  # "1:1": a worker process a side (the default)
        with LLM(model_dir, device="cpu", dtype="float32", disaggregate=disaggregate, **OPTIONS) as llm:
            for name, path in adapters.items():
                llm.add_adapter(name, path)
            generated = llm.generate(prompt_token_ids=prompts, sampling_params=_greedy(),
                                     adapters=list(NAMES))
            outputs[disaggregate] = [output.token_ids for output in generated]
            if disaggregate:
                assert llm.engine.prefill.executor is not None and llm.engine.decode.executor is not None
                _assert_nothing_held(llm.engine)
    assert outputs["1:1"] == outputs[None]
    with pytest.raises(ConfigError, match="disaggregate"):
        LLM(model_dir, device="cpu", dtype="float32", disaggregate="2:1")


@pytest.mark.parametrize(("processes", "concurrent"), [(False, False), (True, True)],
                         ids=["one-process", "workers-concurrent"])
def test_pinned_prompts_stay_pinned_on_both_sides_and_are_not_sent_again(case, processes, concurrent,
                                                                        closing):
    _, _, prompts = case
    system = list(range(10, 10 + 3 * BLOCK_SIZE + 1))  # 3 full blocks and a token
    pinned_blocks = len(system) // BLOCK_SIZE
    asks = [system + prompt for prompt in prompts[:6]]
    names = ["lora16", "lora16", None, "lora16", "dora16-all", "lora16"]
    expected_engine = _colocated(case)
    expected_engine.pin_prompt("desk", system, tenant=TENANTS[0], adapter="lora16")
    engine = _disaggregated(case, processes=processes, closing=closing, concurrent=concurrent)
    engine.pin_prompt("desk", system, tenant=TENANTS[0], adapter="lora16")
    _run(engine)  # the warm-up: computed on the prefill side, its blocks sent once
    assert engine.prefill.pinned_prompts() == engine.decode.pinned_prompts() == {"desk": pinned_blocks}
    assert engine.num_blocks_sent == pinned_blocks
    _run(expected_engine)
    for target in (expected_engine, engine):
        for i, (ask, name) in enumerate(zip(asks, names)):
            target.add_request(f"r{i}", prompt_token_ids=ask, params=_greedy(), adapter=name,
                               tenant=TENANTS[0])
    assert _run(engine) == _run(expected_engine)
    # The requests of the pin's tenant and adapter found it on the decode side: only the rest of
    # their prompt blocks was sent, and the decode side computed no prompt token.
    uses_pin = [name == "lora16" for name in names]
    total = sum(-(-len(ask) // BLOCK_SIZE) for ask in asks)
    assert engine.num_blocks_reused == pinned_blocks * sum(uses_pin)
    assert engine.num_blocks_sent == pinned_blocks + total - pinned_blocks * sum(uses_pin)
    assert engine.decode.num_prompt_tokens == 0
    _assert_nothing_held(engine, pinned_blocks)
    engine.unpin_prompt("desk")
    assert engine.prefill.pinned_prompts() == engine.decode.pinned_prompts() == {}
    _assert_nothing_held(engine)


@pytest.mark.parametrize(("processes", "staging_blocks"), [(False, None), (True, 0), (True, None)],
                         ids=["one-process", "workers", "workers-staged"])
def test_aborts_between_the_sides_and_on_each_side_leak_nothing(case, processes, staging_blocks, closing):
    """One decode place: prefilled requests queue on the decode side, their KV still on the
    prefill side (or, pushed, in the decode side's staging area). Aborting them there frees the
    prefill side's blocks (or their staging run), and so does aborting one whose push is still
    on its way (once it is answered); aborts on either side too; the rest give the colocated
    engine's tokens."""
    _, _, prompts = case
    colocated = _colocated(case)
    _add_all(colocated, prompts, _greedy())
    expected = _run(colocated)
    engine = _disaggregated(case, decode_options=dict(max_num_seqs=1), processes=processes, closing=closing,
                            staging_blocks=staging_blocks)
    staged = staging_blocks is None and processes
    _add_all(engine, prompts, _greedy())
    aborted = {}

    def abort_some(engine):
        pushing = [r for r in engine._pushing if r not in aborted.values()]
        if staged and pushing and "pushing" not in aborted:  # its blocks on their way to staging
            free = engine._staging.num_free_blocks
            assert engine.abort(pushing[0]) and not engine.abort(pushing[0])
            assert engine._staging.num_free_blocks == free  # (its run goes once the push is answered)
            aborted["pushing"] = pushing[0]
        elif engine._transit and "between" not in aborted:
            request_id = next(iter(engine._transit))
            held, free = engine.prefill.blocks.num_used_blocks, engine._staging.num_free_blocks
            assert engine.abort(request_id)
            num_blocks = -(-len(prompts[int(request_id[1:])]) // BLOCK_SIZE)
            if staged:
                assert engine._staging.num_free_blocks == free + num_blocks
            else:
                assert engine.prefill.blocks.num_used_blocks == held - num_blocks
            aborted["between"] = request_id
        elif "prefill" not in aborted and engine.prefill.has_request("r11"):
            assert engine.abort("r11")
            aborted["prefill"] = "r11"
        elif "decode" not in aborted and engine.decode.scheduler.running:
            request_id = engine.decode.scheduler.running[0].request_id
            assert engine.abort(request_id)
            aborted["decode"] = request_id

    outputs = _run(engine, abort_some)
    assert set(aborted) == {"between", "prefill", "decode"} | ({"pushing"} if staged else set())
    assert len(set(aborted.values())) == len(aborted)
    assert set(outputs) == set(expected) - set(aborted.values())
    assert outputs == {k: v for k, v in expected.items() if k in outputs}
    assert not engine.abort(aborted["between"])
    _assert_nothing_held(engine)


@pytest.mark.parametrize(("swap_space", "processes"), [(4.0, False), (0.0, False), (4.0, True)],
                         ids=["swap", "recompute", "swap-workers"])
def test_a_decode_side_short_of_kv_preempts_and_still_matches(case, swap_space, processes, closing):
    _, _, prompts = case
    colocated = _colocated(case)
    _add_all(colocated, prompts, _greedy(24))
    expected = _run(colocated)
    engine = _disaggregated(case, decode_options=dict(num_kv_blocks=24, swap_space=swap_space),
                            processes=processes, closing=closing)
    _add_all(engine, prompts, _greedy(24))
    assert _run(engine) == expected
    scheduler = engine.decode.scheduler
    assert scheduler.num_preemptions > 0
    assert {mode for _, mode in scheduler.preemptions} == {"swap" if swap_space else "recompute"}
    assert engine.prefill.scheduler.num_preemptions == 0
    _assert_nothing_held(engine)


def test_copy_kv_blocks_copies_block_by_block():
    source = torch.arange(6 * 2 * 2 * 4 * 3, dtype=torch.float32).reshape(6, 2, 2, 4, 3)
    target = torch.zeros(5, 2, 2, 4, 3)
    copy_kv_blocks(source, [1, 2, 5], target, [3, 4, 0])
    for src, dst in ((1, 3), (2, 4), (5, 0)):
        assert torch.equal(target[dst], source[src])
    assert not target[1:3].any()
    with pytest.raises(ValueError, match="cannot be copied"):
        copy_kv_blocks(source, [0], torch.zeros(2, 2, 2, 4, 2), [0])


@pytest.mark.parametrize("swap_space", [4.0, 0.0], ids=["swap", "recompute"])
def test_a_request_preempted_while_its_first_token_is_in_flight_is_computed_on_the_decode_side(
        case, swap_space):
    """Async scheduling: the step that samples its first token is still in flight when the
    prefill side preempts it; it leaves with no blocks, and the decode side computes it again."""
    _, _, prompts = case
    colocated = _colocated(case)
    _add_all(colocated, prompts, _greedy())
    expected = _run(colocated)
    engine = _disaggregated(case, async_scheduling=True, swap_space=swap_space)
    _add_all(engine, prompts, _greedy())
    preempted = []

    def preempt_in_flight(engine):
        for request in engine.prefill.scheduler.running:
            if request.num_pending and not preempted:
                engine.prefill.preempt(request.request_id)
                preempted.append(request)

    assert _run(engine, preempt_in_flight) == expected
    assert preempted and engine.prefill.scheduler.num_preemptions == 1
    (request,) = preempted
    # The decode side computed its prompt and first token (tokens that sample are not counted),
    # and nothing of it was sent.
    assert engine.decode.num_prompt_tokens == request.num_prompt_tokens
    num_prompt_blocks = sum(-(-len(p) // BLOCK_SIZE) for p in prompts)
    assert engine.num_blocks_sent == num_prompt_blocks - -(-request.num_prompt_tokens // BLOCK_SIZE)
    _assert_nothing_held(engine)


def test_abort_all_leaves_both_sides_idle(case):
    _, _, prompts = case
    engine = _disaggregated(case, async_scheduling=True, decode_options=dict(max_num_seqs=2))
    engine.pin_prompt("desk", prompts[2][:2 * BLOCK_SIZE], tenant=TENANTS[0], adapter="lora16")
    _add_all(engine, prompts, _greedy())
    for _ in range(30):
        engine.step()
        if engine._transit and engine.decode.scheduler.running and engine.decode.pinned_prompts():
            break
    assert engine._transit and engine.decode.scheduler.running
    num_unfinished = engine.num_requests
    assert 0 < num_unfinished <= len(prompts)
    assert engine.abort_all() == num_unfinished
    assert engine.prefill.pinned_prompts() == engine.decode.pinned_prompts() == {}
    assert not engine.has_unfinished_requests()
    _assert_nothing_held(engine)


def _generate_text(case, disaggregate, prompts, params):
    model_dir, adapters, _ = case
    llm = LLM(model_dir, device="cpu", dtype="float32", disaggregate=disaggregate,
              disaggregate_processes=False, **OPTIONS)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return llm, llm.generate(prompts, params, adapters=["lora16", None, "flora4-all"])


def test_text_stops_and_logprobs_carry_across(case):
    """The detokenizer, stop tokens, sampled and prompt log-probs continue on the decode side as
    on one engine."""
    prompts = ["Hello there, how", "The quick brown fox", "x"]
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    _, first = _generate_text(case, None, prompts, plain)
    tokens = first[0].token_ids
    stop = next(t for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])  # (on the decode side)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop],
                            logprobs=2, prompt_logprobs=1)
    _, expected = _generate_text(case, None, prompts, params)
    llm, outputs = _generate_text(case, "1:1", prompts, params)
    assert expected[0].finish_reason == "stop"
    for ours, theirs in zip(outputs, expected):
        assert (ours.token_ids, ours.text, ours.finish_reason) == (theirs.token_ids, theirs.text,
                                                                    theirs.finish_reason)
        pairs = zip(ours.logprobs + ours.prompt_logprobs[1:], theirs.logprobs + theirs.prompt_logprobs[1:])
        for got, want in pairs:
            assert got.token_id == want.token_id and list(got.top) == list(want.top)
            assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert len(ours.logprobs) == len(ours.token_ids)
        assert len(ours.prompt_logprobs) == len(theirs.prompt_logprobs)
    assert any(output.text for output in outputs)
    _assert_nothing_held(llm.engine)


def test_structured_outputs_continue_their_grammar_on_the_decode_side(case):
    """The grammar matcher, past the first token, goes with the request: seeded sampling under
    the same masks gives the colocated engine's tokens."""
    prompts = ["Pick:", "Code:"]
    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=5, structured=StructuredOutput(regex=regex))
              for regex in (r"[0-9]{3}-[a-c]{2}", r"\((yes|no|maybe)\)")]
    outputs = {}
    for disaggregate in (None, "1:1"):
        model_dir, adapters, _ = case
        llm = LLM(model_dir, device="cpu", dtype="float32", disaggregate=disaggregate,
                  disaggregate_processes=False, **OPTIONS)
        llm.add_adapter("lora16", adapters["lora16"])
        generated = llm.generate(prompts, params, adapters=["lora16", None])
        outputs[disaggregate] = [(o.token_ids, o.text, o.finish_reason) for o in generated]
    assert outputs["1:1"] == outputs[None]
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", outputs[None][0][1])
    assert re.fullmatch(r"\((yes|no|maybe)\)", outputs[None][1][1])
    _assert_nothing_held(llm.engine)

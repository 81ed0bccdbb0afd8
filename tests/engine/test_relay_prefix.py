"""The prefix cache and relay decode in the engine, on CPU in float32, against transformers +
PEFT per request alone: a mixed batch where some requests share a system prompt (same tenant and
adapter: one relay group), some send its text with other adapters or as another tenant (never
grouped with them), some have none; with the prefix cache on and off; requests joining and
leaving a warm group; a member preempted (swapped and recomputed); cached blocks evicted under
pressure. And memory: 64 running requests sharing a 2,048-token prompt hold it once."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine import step_inputs
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.relay_groups import RelayGroups
from loraplex.engine_config import EngineConfig
from loraplex.errors import InvalidRequestError
from loraplex.kernels import select_ops
from tests.engine.test_hf_parity import MAX_TOKENS, _hf_references
from tests.factories import ADAPTERS, make_adapter, make_hf_model

BLOCK_SIZE = 4
SYSTEM_LEN = 37  # 9 full blocks and one token


@dataclass(frozen=True)
class Req:
    key: str
    has_system: bool
    adapter: str | None
    tenant: str
    own_len: int


REQUESTS = (
    Req("a0", True, "qv4", "t1", 3), Req("a1", True, "qv4", "t1", 6), Req("a2", True, "qv4", "t1", 1),
    Req("a3", True, "qv4", "t1", 9),
    Req("other-adapter", True, "all8", "t1", 5), Req("base", True, None, "t1", 4),
    Req("other-tenant", True, "qv4", "t2", 2),
    Req("plain0", False, "qv4", "t1", 11), Req("plain1", False, None, "t1", 7),
)
GROUP = {"a0", "a1", "a2", "a3"}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    folder = tmp_path_factory.mktemp("relay")
    hf = make_hf_model("llama", folder / "model")
    adapters = {spec.name: make_adapter(hf, spec, folder / "adapters", seed=i + 1)
                for i, spec in enumerate(ADAPTERS)}
    generator = torch.Generator().manual_seed(12)  # prompts whose greedy tokens never hit eos
    system = torch.randint(3, 300, (SYSTEM_LEN,), generator=generator).tolist()
    prompts = {r.key: (system if r.has_system else []) + torch.randint(
        3, 300, (r.own_len,), generator=generator).tolist() for r in REQUESTS}
    references = _hf_references(hf, adapters, list(prompts.values()), [r.adapter for r in REQUESTS])
    return folder / "model", adapters, prompts, dict(zip(prompts, references))


def _llm(case, **options) -> LLM:
    model_dir, adapters, _, _ = case
    options = {"block_size": BLOCK_SIZE, "max_num_batched_tokens": 16, "relay_attention": "always",
               **options}
    llm = LLM(model_dir, device="cpu", dtype="float32", **options)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return llm


class GroupLog:
    """Records the relay groups of every decode step, as sets of request keys."""

    def __init__(self, monkeypatch) -> None:
        self.groups: list[frozenset[str]] = []
        self._ids: list[str] = []
        fill, find = step_inputs.StepInputs.fill, step_inputs.find_groups

        def logged_fill(inputs, plan, batch, *padding):
            self._ids = plan.request_ids
            return fill(inputs, plan, batch, *padding)

        def logged_find(*args) -> RelayGroups:
            groups = find(*args)
            starts = groups.group_starts.tolist()
            for g in range(groups.num_groups):
                rows = groups.members[starts[g]:starts[g + 1]].tolist()
                self.groups.append(frozenset(self._ids[r] for r in rows))
            return groups

        monkeypatch.setattr(step_inputs.StepInputs, "fill", logged_fill)
        monkeypatch.setattr(step_inputs, "find_groups", logged_find)


def _params(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _add(llm: LLM, case, key: str, max_tokens: int = MAX_TOKENS) -> None:
    _, _, prompts, _ = case
    spec = next(r for r in REQUESTS if r.key == key)
    llm.engine.add_request(key, prompt_token_ids=prompts[key], params=_params(max_tokens),
                           adapter=spec.adapter, tenant=spec.tenant)


def _run_all(llm: LLM) -> dict[str, list[int]]:
    tokens = {}
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            if output.finished:
                tokens[output.request_id] = output.token_ids
    return tokens


def _load_adapters(llm: LLM, names: set[str | None]) -> None:
    """Run a one-token request per adapter, so that all are resident before a test's requests
    arrive: which requests run side by side then depends on the scheduler alone, not on which
    adapter's load a busy machine finished first."""
    for name in sorted(n for n in names if n is not None):
        llm.engine.add_request(f"load-{name}", prompt_token_ids=[5], params=_params(1), adapter=name)
    _run_all(llm)


def _check(tokens: dict[str, list[int]], case) -> None:
    _, _, _, references = case
    for key, got in tokens.items():
        want = references[key][0][:len(got)]
        assert got == want, key


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mixed_batch_groups_only_same_tenant_and_adapter(case, monkeypatch, prefix_cache, async_scheduling):
    log = GroupLog(monkeypatch)
    llm = _llm(case, enable_prefix_caching=prefix_cache, async_scheduling=async_scheduling,
               max_num_batched_tokens=64)
    _load_adapters(llm, {r.adapter for r in REQUESTS})
    for r in REQUESTS:
        _add(llm, case, r.key)
    tokens = _run_all(llm)
    assert set(tokens) == {r.key for r in REQUESTS}
    _check(tokens, case)
    assert all(len(t) == MAX_TOKENS for t in tokens.values())
    if prefix_cache:  # the group's members computed the system prompt once and read it together
        # (all four, or the three that took the prompt from the first)
        assert any(len(group) >= 3 for group in log.groups), log.groups
        assert llm.engine.blocks.num_hit_tokens >= 3 * (SYSTEM_LEN // BLOCK_SIZE) * BLOCK_SIZE
    assert all(group <= GROUP for group in log.groups), "only same tenant and adapter share"
    assert llm.engine.blocks.num_used_blocks == 0


def test_relay_off_and_auto_give_the_same_tokens(case, monkeypatch):
    log = GroupLog(monkeypatch)
    for mode in ("off", "auto"):  # auto: a 36-token prefix is far below where relay pays
        llm = _llm(case, relay_attention=mode)
        for key in sorted(GROUP):
            _add(llm, case, key)
        _check(_run_all(llm), case)
    assert log.groups == []


def test_requests_join_and_leave_a_warm_group(case, monkeypatch):
    log = GroupLog(monkeypatch)
    llm = _llm(case)
    _add(llm, case, "a0", max_tokens=MAX_TOKENS)
    _add(llm, case, "a1", max_tokens=3)  # leaves early
    tokens = {}

    def step() -> None:
        for output in llm.engine.step():
            if output.finished:
                tokens[output.request_id] = output.token_ids

    scheduler = llm.engine.scheduler
    while scheduler.num_waiting or not all(r.num_output_tokens for r in scheduler.running):
        step()
    step()  # a decode step of the warm group
    hits = llm.engine.blocks.num_hit_tokens
    _add(llm, case, "a2")  # joins the warm group: prefills only its own tokens
    step()
    assert llm.engine.blocks.num_hit_tokens - hits == (SYSTEM_LEN // BLOCK_SIZE) * BLOCK_SIZE
    _add(llm, case, "a3")
    tokens.update(_run_all(llm))
    _check(tokens, case)
    assert len(tokens["a1"]) == 3 and len(tokens["a3"]) == MAX_TOKENS
    assert {"a0", "a1"} in log.groups and {"a0", "a2", "a3"} in log.groups
    assert llm.engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize("swap_space", [4.0, 0.0], ids=["swap", "recompute"])
def test_a_preempted_member_resumes_and_rejoins(case, monkeypatch, swap_space):
    log = GroupLog(monkeypatch)
    llm = _llm(case, swap_space=swap_space)
    for key in sorted(GROUP):
        _add(llm, case, key)
    engine = llm.engine
    while sum(r.num_output_tokens > 1 for r in engine.scheduler.running) < len(GROUP):
        engine.step()
    engine.preempt("a1")
    engine.step()
    assert engine.scheduler.num_preemptions == 1
    if swap_space:  # the system prompt's full blocks, which its group holds too, stayed on the
        # device; its own prompt blocks went to the host with the rest (left as evictable
        # cache, the pressure that preempts a request would evict them)
        a1 = engine._requests["a1"]
        num_blocks = -(-a1.num_computed_tokens // BLOCK_SIZE)
        assert engine.scheduler.num_blocks_swapped_out == num_blocks - SYSTEM_LEN // BLOCK_SIZE
    tokens = _run_all(llm)
    _check(tokens, case)
    assert set(tokens) == GROUP
    resumed = log.groups[-1]
    assert "a1" in resumed, "the resumed member reads the shared prefix with its group again"
    assert engine.blocks.num_used_blocks == 0


def test_cached_blocks_are_evicted_under_pressure_and_recomputed(case):
    llm = _llm(case, num_kv_blocks=16, max_num_seqs=4)
    _add(llm, case, "a0")
    _check(_run_all(llm), case)
    blocks = llm.engine.blocks
    assert blocks.num_cached_blocks >= SYSTEM_LEN // BLOCK_SIZE
    assert blocks.num_used_blocks == 0  # cached blocks nobody holds count as free
    _add(llm, case, "plain0")
    _add(llm, case, "other-tenant")  # needs more blocks than the plain free list has
    _check(_run_all(llm), case)
    assert blocks.num_evicted_blocks > 0
    for key in ("a1", "a2"):  # the evicted prefix is computed again, correctly
        _add(llm, case, key)
    _check(_run_all(llm), case)
    assert blocks.num_used_blocks == 0


def test_64_requests_sharing_a_2048_token_prompt_hold_it_once():
    from loraplex.benchmarks.synthetic import model_config, random_model

    config = model_config(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                               max_position_embeddings=4096, rope_scaling=None))
    device = torch.device("cpu")
    model = random_model(config, select_ops(device, "reference"), torch.float32, device, 4096)
    engine = LLMEngine(EngineConfig.from_kwargs(
        "synthetic", device="cpu", dtype="float32", block_size=16, num_kv_blocks=1024,
        max_num_seqs=64, max_num_batched_tokens=2048 + 64 * 8, relay_attention="always"), model=model)
    system = torch.randint(3, 64, (2048,), generator=torch.Generator().manual_seed(0)).tolist()
    for i in range(64):
        own = torch.randint(3, 64, (8,), generator=torch.Generator().manual_seed(i + 1)).tolist()
        engine.add_request(f"r{i}", prompt_token_ids=system + own, params=_params(4))
    while len(engine.scheduler.running) < 64 or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    running = engine.scheduler.running
    prefix = running[0].block_ids[:2048 // 16]
    assert all(r.block_ids[:128] == prefix for r in running)
    # The prompt's 128 blocks once, and one block of its own for each request's 8 + 4 tokens.
    assert engine.blocks.num_used_blocks == 128 + 64
    assert engine.blocks.num_shared_blocks == 128
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.blocks.num_used_blocks == 0


def test_a_pinned_prompt_survives_pressure_until_unpinned(case):
    _, _, prompts, _ = case
    llm = _llm(case, num_kv_blocks=24, max_num_seqs=4)  # 9 pinned: each request alone fits the rest
    engine = llm.engine
    engine.pin_prompt("t1/desk", prompts["a0"][:SYSTEM_LEN], tenant="t1", adapter="qv4")
    assert _run_all(llm) == {}  # the warm-up's output is the engine's own
    assert engine.pinned_prompts() == {"t1/desk": SYSTEM_LEN // BLOCK_SIZE}
    for key in ("plain0", "base", "other-tenant"):  # more than the unpinned blocks: evictions
        _add(llm, case, key)
    _check(_run_all(llm), case)
    hits = engine.blocks.num_hit_tokens
    _add(llm, case, "a1")
    _check(_run_all(llm), case)
    assert engine.blocks.num_hit_tokens - hits == (SYSTEM_LEN // BLOCK_SIZE) * BLOCK_SIZE
    engine.unpin_prompt("t1/desk")
    assert engine.blocks.num_used_blocks == 0


def test_a_request_that_never_fits_beside_the_pins_is_refused(case):
    """24 blocks of 4, 9 of them pinned: a prompt of another tenant has room for 15 blocks (60
    tokens), one that starts with the pinned prompt shares them (the whole cache); output stops
    where the room ends; a request queued before the pin landed fails instead of waiting."""
    _, _, prompts, _ = case
    llm = _llm(case, num_kv_blocks=24, max_num_seqs=4)
    engine = llm.engine
    long = [7 + i % 200 for i in range(70)]  # 18 blocks: fits now, not beside the pin
    engine.pin_prompt("t1/desk", prompts["a0"][:SYSTEM_LEN], tenant="t1", adapter="qv4")
    engine.add_request("queued", prompt_token_ids=long, params=_params(), tenant="t2")
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
    assert engine.pinned_prompts() == {"t1/desk": 9}
    assert outputs["queued"].finish_reason == "error" and "room for 60 tokens" in outputs["queued"].error
    with pytest.raises(InvalidRequestError, match="room for 60 tokens"):
        engine.add_request("long", prompt_token_ids=long, params=_params(), tenant="t2")
    engine.add_request("capped", prompt_token_ids=long[:56], params=_params(), tenant="t2")
    engine.add_request("shares", prompt_token_ids=prompts["a0"] + long[:40], params=_params(),
                       adapter="qv4", tenant="t1")
    tokens = _run_all(llm)
    assert len(tokens["capped"]) == 60 - 56 and len(tokens["shares"]) == MAX_TOKENS
    engine.unpin_prompt("t1/desk")
    engine.add_request("long", prompt_token_ids=long, params=_params(), tenant="t2")
    assert len(_run_all(llm)["long"]) == MAX_TOKENS

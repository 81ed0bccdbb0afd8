"""Structured outputs in the engine: each constrained request follows its own grammar (JSON
schema, regex, choice, EBNF) beside unconstrained ones on other adapters, whose tokens do not
change; preemption, `n` and logprobs keep working; a constraint that cannot compile is refused
naming its field."""

from __future__ import annotations

import json
import re

import pytest

from loraplex import LLM, SamplingParams
from loraplex.engine.cuda_graphs import DecodeGraphs
from loraplex.engine.grammar import GrammarError
from loraplex.types import StructuredOutput

# (a pattern, not maxLength: xgrammar 0.2.8 lets control characters into strings bounded by
# maxLength, which JSON parsers refuse)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
    "size": {"enum": ["small", "large"]},
    "ok": {"type": "boolean"}}, "required": ["name", "size", "ok"], "additionalProperties": False}
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25], [30, 31]]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(tiny_llama, request):
    model, adapters = tiny_llama
    llm = LLM(model, device="cpu", block_size=4, num_kv_blocks=64, max_num_batched_tokens=16,
              async_scheduling=request.param)
    llm.add_adapter("qv4", adapters["qv4"])
    llm.add_adapter("all8", adapters["all8"])
    return llm


def constrained(spec: StructuredOutput, **options) -> SamplingParams:
    return SamplingParams(**({"max_tokens": 60, "temperature": 1.0, "seed": 5} | options), structured=spec)


def test_each_kind_of_constraint_shapes_the_output(llm):
    specs = {"json": StructuredOutput(json_schema=json.dumps(SCHEMA)),
             "regex": StructuredOutput(regex=r"[0-9]{3}-[a-c]{2}"),
             "choice": StructuredOutput(choice=("yes", "no", "maybe")),
             "grammar": StructuredOutput(grammar='root ::= "(" [a-z]+ ")" | "[" [0-9] "]"')}
    outputs = llm.generate(prompt_token_ids=[PROMPTS[0]] * 4,
                           sampling_params=[constrained(spec) for spec in specs.values()],
                           adapters=["qv4", None, "all8", None])
    by_kind = dict(zip(specs, outputs))
    value = json.loads(by_kind["json"].text)
    assert set(value) == {"name", "size", "ok"} and value["size"] in ("small", "large")
    assert isinstance(value["ok"], bool) and re.fullmatch("[a-z]{1,8}", value["name"])
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", by_kind["regex"].text)
    assert by_kind["choice"].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"\([a-z]+\)|\[[0-9]\]", by_kind["grammar"].text) or \
        by_kind["grammar"].finish_reason == "length"
    for kind in ("json", "regex", "choice"):
        assert by_kind[kind].finish_reason == "stop", kind


def test_unconstrained_requests_keep_their_tokens_beside_a_constrained_one(llm):
    free = [SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)]
    # The constrained one cannot end before max_tokens (30 letters needed), so both batches
    # hold three requests at every step.
    spec = StructuredOutput(regex="[a-z]{30}")
    adapters = ["qv4", "all8", None]
    alone = llm.generate(prompt_token_ids=PROMPTS, adapters=adapters,
                         sampling_params=[*free, SamplingParams(max_tokens=12, seed=3, ignore_eos=True)])
    mixed = llm.generate(prompt_token_ids=PROMPTS, adapters=adapters,
                         sampling_params=[*free, constrained(spec, max_tokens=12, seed=3)])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone[:2]]
    assert re.fullmatch("[a-z]{12}", mixed[2].text)
    assert mixed[2].token_ids != alone[2].token_ids


def test_n_samples_and_logprobs_follow_the_grammar(llm):
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA))
    engine = llm.engine
    params = constrained(spec, logprobs=2, seed=None)
    engine.add_request("first", prompt_token_ids=PROMPTS[1], params=params, adapter="qv4")
    for i in range(1, 4):
        engine.add_request(f"first.{i}", prompt_token_ids=PROMPTS[1], params=params, adapter="qv4",
                           sample_of="first")
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert len(finished) == 4
    for output in finished.values():
        assert json.loads(output.text)["size"] in ("small", "large")
        assert len(output.logprobs) == len(output.token_ids)
        for entry, token in zip(output.logprobs, output.token_ids):
            assert entry.token_id == token and entry.logprob <= 0 and len(entry.top) == 2


def test_a_preempted_constrained_request_resumes_in_its_grammar(tiny_llama):
    model, _ = tiny_llama
    spec = StructuredOutput(regex="[a-z]{40}")
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=21, structured=spec)
    prompts = [[5 + i] * (3 + 4 * i) for i in range(4)]
    roomy = LLM(model, device="cpu", block_size=4, max_num_batched_tokens=16)
    expected = [o.text for o in roomy.generate(prompt_token_ids=prompts, sampling_params=params)]
    for async_scheduling in (False, True):
        tight = LLM(model, device="cpu", block_size=4, num_kv_blocks=16, max_num_batched_tokens=16,
                    async_scheduling=async_scheduling)
        texts = [o.text for o in tight.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert tight.engine.scheduler.num_preemptions > 0
        assert texts == expected
        assert all(re.fullmatch("[a-z]{40}", text) for text in texts)


@pytest.mark.parametrize(("spec", "reason"), [
    (StructuredOutput(json_schema="{not json", param="response_format.json_schema.schema"), "not JSON"),
    (StructuredOutput(json_schema='{"type": "object", "properties": {"a": {"type": "nonsense"}}}',
                      param="guided_json"), "cannot be compiled"),
    (StructuredOutput(regex="[a-z", param="structured_outputs.regex"), "cannot be compiled"),
    (StructuredOutput(grammar="root ::= undefined_rule", param="guided_grammar"), "cannot be compiled"),
])
def test_a_constraint_that_cannot_compile_is_refused_naming_its_field(llm, spec, reason):
    with pytest.raises(GrammarError) as info:
        llm.engine.add_request("bad", prompt_token_ids=[5], params=constrained(spec))
    assert info.value.param == spec.param and reason in info.value.message
    assert spec.param in info.value.message
    assert "bad" not in llm.engine._requests


def test_compiled_grammars_are_cached_by_content(llm):
    grammars = llm.engine.grammars
    before = grammars.num_compiled
    spec = StructuredOutput(regex="[xyz]{4}", param="guided_regex")
    first = grammars.compile(spec)
    again = grammars.compile(StructuredOutput(regex="[xyz]{4}", param="structured_outputs.regex"))
    assert again is first and grammars.num_compiled == before + 1


def trace(name: str, method, calls: list):
    """`method`, appending its name to `calls` at each call (sample_masked: with whether the
    step is a padded decode step)."""
    def traced(*args):
        calls.append(("sample_masked", args[0].filled.shape.is_padded_decode)
                     if name == "sample_masked" else name)
        return method(*args)
    return traced


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_padded_decode_steps_draw_masked_rows_again_with_the_same_tokens(tiny_llama, async_scheduling):
    """The path the decode graphs replay (run eagerly on CPU): constrained and unconstrained
    requests on different adapters give the tokens of the plain path; the masked rows are drawn
    again after the forward pass, and with async scheduling the step in flight is collected and
    the masks filled between the two (the forward pass already queued)."""
    model, adapters = tiny_llama
    specs = [StructuredOutput(json_schema=json.dumps(SCHEMA)), StructuredOutput(regex="[a-z]{30}"),
             None, None, StructuredOutput(choice=("yes", "no", "maybe")), None]
    params = [SamplingParams(max_tokens=60 if i == 0 else 20, temperature=0.0 if i % 3 == 1 else 1.0,
                             seed=40 + i, ignore_eos=spec is None, structured=spec)
              for i, spec in enumerate(specs)]
    prompts = [[5 + i] * (2 + i) for i in range(len(specs))]
    names = ["qv4", None, "all8", "qv4", None, "all8"]

    def run(static: bool, async_scheduling: bool):
        llm = LLM(model, device="cpu", block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                  async_scheduling=async_scheduling)
        for name, path in adapters.items():
            llm.add_adapter(name, path)
        runner, calls = llm.engine.runner, []
        if static:
            runner.graphs = DecodeGraphs(runner, max_batch=8, vocab_size=runner.model.config.vocab_size,
                                         capture=False)
        for name in ("begin", "finish", "collect", "sample_masked"):
            setattr(runner, name, trace(name, getattr(runner, name), calls))
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, adapters=names)
        return [o.token_ids for o in outputs], [o.text for o in outputs], calls

    plain, _, _ = run(static=False, async_scheduling=False)
    tokens, texts, calls = run(static=True, async_scheduling=async_scheduling)
    assert tokens == plain
    assert set(json.loads(texts[0])) == {"name", "size", "ok"}
    assert re.fullmatch("[a-z]{20}", texts[1]) and texts[4] in ("yes", "no", "maybe")
    assert ("sample_masked", True) in calls  # masked rows drawn again on padded decode steps
    overlapped = any(calls[i:i + 3] == ["begin", "collect", "finish"] for i in range(len(calls)))
    assert overlapped == async_scheduling


@pytest.mark.gpu
def test_constrained_decode_steps_replay_the_masked_graphs_on_gpu(tiny_llama):
    """On CUDA a decode step with constrained requests replays its decode graph and the masked
    sampling graph (no eager step for masks), the outputs follow their grammars, and overlapped
    steps (async: the masks filled while the forward pass runs) give the tokens of steps run one
    at a time."""
    model, adapters = tiny_llama
    specs = [StructuredOutput(json_schema=json.dumps(SCHEMA)), None, StructuredOutput(regex="[a-z]{30}"),
             None]
    # (room for the JSON answer whatever the GPU's logits make of it: its fields are bounded)
    params = [SamplingParams(max_tokens=200 if i == 0 else 20, temperature=1.0 if i % 2 else 0.0, seed=i,
                             ignore_eos=spec is None, structured=spec) for i, spec in enumerate(specs)]

    def run(async_scheduling: bool):
        llm = LLM(model, device="cuda", dtype="float32", max_num_seqs=8, async_scheduling=async_scheduling)
        for name, path in adapters.items():
            llm.add_adapter(name, path)
        graphs, replays = llm.engine.runner.graphs, []
        original = graphs.replay_masked
        graphs.replay_masked = lambda shape: replays.append(shape.num_seqs) or original(shape)
        outputs = llm.generate(prompt_token_ids=PROMPTS + [[40, 41]], sampling_params=params,
                               adapters=["qv4", "all8", None, "qv4"])
        return [o.token_ids for o in outputs], [o.text for o in outputs], replays

    tokens, texts, replays = run(async_scheduling=True)
    assert len(replays) >= 10
    assert set(json.loads(texts[0])) == {"name", "size", "ok"} and re.fullmatch("[a-z]{20}", texts[2])
    assert run(async_scheduling=False)[0] == tokens


def test_swapped_and_aborted_requests_on_overlapped_padded_steps(tiny_llama):
    """The decode graphs' path with overlapped steps (a step's masks filled after its forward
    pass is queued) and a KV cache too small for the batch: constrained requests swapped out and
    back keep their grammars and give the texts of a roomy run; one aborted mid-way leaves the
    others unchanged and every block free."""
    model, _ = tiny_llama
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=21,
                            structured=StructuredOutput(regex="[a-z]{40}"))
    prompts = [[5 + i] * (3 + 4 * i) for i in range(4)]
    roomy = LLM(model, device="cpu", block_size=4, max_num_batched_tokens=16)
    expected = [o.text for o in roomy.generate(prompt_token_ids=prompts, sampling_params=params)]
    engine = LLM(model, device="cpu", block_size=4, num_kv_blocks=16, max_num_batched_tokens=16,
                 max_num_seqs=8, async_scheduling=True).engine
    engine.runner.graphs = DecodeGraphs(engine.runner, max_batch=8, capture=False,
                                        vocab_size=engine.runner.model.config.vocab_size)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=prompt, params=params)
    engine.add_request("aborted", prompt_token_ids=[9] * 5, params=params)
    texts, num_steps = {}, 0
    while engine.has_unfinished_requests():
        texts |= {o.request_id: o.text for o in engine.step() if o.finished}
        num_steps += 1
        if num_steps == 8:
            assert engine.abort("aborted")
    assert sum(n for (_, mode), n in engine.scheduler.preemptions.items() if mode == "swap") > 0
    assert [texts[str(i)] for i in range(4)] == expected and "aborted" not in texts
    assert engine.blocks.num_used_blocks == 0

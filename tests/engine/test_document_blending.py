"""Registered documents blended into prompts (CacheBlend, loraplex.engine.blending), on CPU in
float32 on a tiny random Llama: with 100% recompute the greedy tokens and log-probs are full
prefill's, under an adapter of each family too; a document's KV is computed once (per adapter)
and reused by requests that place it elsewhere and in another order; a partial share reuses the
rest; the Triton kernels blend as the reference."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine import blending
from loraplex.engine.blending import DocumentBlend, blend_prefill, copy_document_kv
from loraplex.errors import InvalidRequestError
from loraplex.types import StreamingWindow
from tests.factories import (
    ALL_SEVEN,
    ATTENTION,
    AdapterSpec,
    make_adapter,
    make_dora_adapter,
    make_flora_adapter,
    make_hf_model,
    make_ia3_adapter,
)

BLOCK_SIZE = 4
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Four layers (with two, layers 0 and 1 are all there is: every share is exact), weights
    large enough that greedy choices are not near-ties. (folder, the transformers model)"""
    folder = tmp_path_factory.mktemp("blend")
    hf = make_hf_model("llama", folder / "model", config={"num_hidden_layers": 4, "initializer_range": 0.15})
    return folder, hf


@pytest.fixture(scope="module")
def model_dir(base):
    return base[0] / "model"


@pytest.fixture(scope="module")
def llm(base, model_dir) -> LLM:
    llm = LLM(model_dir, device="cpu", dtype="float32", block_size=BLOCK_SIZE, max_num_batched_tokens=64)
    folder, hf = base
    adapters = {
        "lora": make_adapter(hf, AdapterSpec("lora", ALL_SEVEN, rank=8, alpha=16), folder, seed=1),
        "dora": make_dora_adapter(hf, folder / "dora", ATTENTION, rank=4, alpha=8, seed=2),
        "ia3": make_ia3_adapter(hf, folder / "ia3", ALL_SEVEN, feedforward=("down_proj",), seed=3),
        "flora": make_flora_adapter(hf, folder / "flora", ALL_SEVEN, rank=2, seed=4),
    }
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return llm


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


DOCS = {"a": _tokens(1, 23), "b": _tokens(2, 18), "c": _tokens(3, 9),
        "d": _tokens(10, 12), "e": _tokens(11, 13)}  # d, e: only in test_documents_kv_is_each_adapters_own
HEAD, QUESTION = _tokens(4, 5), _tokens(5, 7)


def _prompt(order: str) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    tokens, spans = list(HEAD), []
    for name in order:
        spans.append((len(tokens), len(tokens) + len(DOCS[name])))
        tokens += DOCS[name]
    return tokens + QUESTION, tuple(spans)


def _run(llm: LLM, request_id: str, order: str, share: float | None,
         adapter: str | None = None) -> tuple[list[int], list[float]]:
    tokens, spans = _prompt(order)
    documents = None if share is None else DocumentBlend(spans, share)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    llm.engine.add_request(request_id, prompt_token_ids=tokens, params=params, documents=documents,
                           adapter=adapter)
    ids, logprobs = [], []
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            ids, logprobs = output.token_ids, [entry.logprob for entry in output.logprobs or []]
    return list(ids), logprobs


def test_full_recompute_is_full_prefill_and_documents_are_computed_once(llm: LLM) -> None:
    engine = llm.engine
    engine.blocks.reset_prefix_cache()
    for i, order in enumerate(("abc", "cab", "ba")):
        reference, reference_logprobs = _run(llm, f"full-{i}", order, None)
        computed = engine.num_document_prefills
        blended, logprobs = _run(llm, f"blend-{i}", order, 1.0)
        assert blended == reference, order
        assert logprobs == pytest.approx(reference_logprobs, abs=1e-4), order
        if i == 0:
            assert engine.num_document_prefills == computed + 3  # each computed alone, once
        else:  # found in the prefix cache's pool, wherever the prompt puts them
            assert engine.num_document_prefills == computed
    assert engine.num_blended_prompts >= 3


@pytest.mark.parametrize("family", ["lora", "dora", "ia3", "flora"])
def test_full_recompute_under_an_adapter_is_its_full_prefill(llm: LLM, family: str) -> None:
    """The blend's passes carry the request's adapter: 100% recompute is that adapter's full
    prefill (tokens and log-probs), and the documents' KV is the adapter's own: computed once
    under it (not taken from the base model's or another adapter's), reused by it after."""
    engine = llm.engine
    _run(llm, f"base-{family}", "abc", 1.0)  # the documents under the base model (cached, maybe before)
    blended_before, computed = engine.num_blended_prompts, engine.num_document_prefills
    reference, reference_logprobs = _run(llm, f"full-{family}", "cab", None, family)
    base_ids, _ = _run(llm, f"full-base-{family}", "cab", None)
    assert reference != base_ids  # the adapter changes the answer: its use is seen
    blended, logprobs = _run(llm, f"blend-{family}", "cab", 1.0, family)
    assert blended == reference
    assert logprobs == pytest.approx(reference_logprobs, abs=1e-4)
    assert engine.num_blended_prompts == blended_before + 1
    assert engine.num_document_prefills == computed + 3  # the adapter's own, not the base model's
    _run(llm, f"again-{family}", "bca", 0.5, family)
    assert engine.num_document_prefills == computed + 3


def test_documents_kv_is_each_adapters_own(llm: LLM) -> None:
    """A document computed under one adapter is not reused for another: each computes its own
    once, and finds it again after the other's."""
    engine = llm.engine
    computed = engine.num_document_prefills
    _run(llm, "own-lora", "de", 1.0, "lora")
    assert engine.num_document_prefills == computed + 2
    _run(llm, "own-dora", "de", 1.0, "dora")
    assert engine.num_document_prefills == computed + 4
    for adapter in ("lora", "dora"):
        _run(llm, f"own-{adapter}-again", "ed", 1.0, adapter)
    assert engine.num_document_prefills == computed + 4


def test_partial_share_reuses_documents(llm: LLM) -> None:
    engine = llm.engine
    _run(llm, "warm", "abc", 0.5)
    reused, computed = engine.num_blend_reused_tokens, engine.num_document_prefills
    ids, _ = _run(llm, "half", "bca", 0.5)
    # a (20 of 23 tokens in full blocks), b (16), c (8): half of 44 reused tokens kept as they are.
    assert engine.num_blend_reused_tokens - reused == 22
    assert engine.num_document_prefills == computed
    assert len(ids) == MAX_TOKENS
    # Reused as they are (no recompute), the documents' KV misses what precedes them: the
    # log-probs move (the reuse is real), while 100% recompute keeps them.
    reference, reference_logprobs = _run(llm, "full", "bca", None)
    _, reused_logprobs = _run(llm, "none", "bca", 0.0)
    assert max(abs(a - b) for a, b in zip(reused_logprobs, reference_logprobs)) > 1e-2


@pytest.mark.parametrize("chunk", [3, 512])
def test_scattered_tokens_attend_as_runs_of_their_own_would(llm: LLM, monkeypatch, chunk: int) -> None:
    """Past layer 1 the selected tokens attend as one sequence, each at its own position (one
    pass over the prompt's keys), in chunks of CHUNK_TOKENS: the same tokens and log-probs as
    sequences of each run of consecutive tokens."""
    monkeypatch.setattr(blending, "CHUNK_TOKENS", chunk)
    ids, logprobs = _run(llm, f"positions-{chunk}", "cab", 0.4)
    with monkeypatch.context() as patch:
        patch.setattr(blending, "_metadata", blending.metadata_by_runs)
        run_ids, run_logprobs = _run(llm, f"runs-{chunk}", "cab", 0.4)
    _, reused_logprobs = _run(llm, f"none-{chunk}", "cab", 0.0)
    assert ids == run_ids
    assert logprobs == pytest.approx(run_logprobs, abs=1e-5)
    assert max(abs(a - b) for a, b in zip(reused_logprobs, run_logprobs)) > 1e-2  # the 40% mattered


def test_a_documents_kv_moved_to_its_place_has_full_prefills_first_layer(llm: LLM) -> None:
    """A layer-0 key depends on its token and position alone: a document's KV computed alone and
    moved to its place in a prompt (its keys rotated on by the offset, copy_document_kv) holds
    exactly the layer-0 keys and values of the prompt's full prefill there; past layer 0 it
    does not (the document never attended to what precedes it: what the recompute is for)."""
    engine = llm.engine
    head, doc = HEAD + QUESTION[:2], DOCS["a"][:20]  # 7 tokens before it: not at a block's start
    prompt, start = head + doc, len(head)
    blocks = [engine.blocks.allocate(-(-n // BLOCK_SIZE)) for n in (len(doc), len(prompt), len(prompt))]
    alone, full, moved = blocks
    try:
        blend_prefill(engine.model, engine.kv_cache, alone, doc, None, 1.0)
        blend_prefill(engine.model, engine.kv_cache, full, prompt, None, 1.0)
        copy_document_kv(engine.kv_cache, alone, moved, start, len(doc), engine.model.cos_sin)

        def kv(table: list[int], layer: int) -> torch.Tensor:  # [2, doc tokens, kv_heads, d]
            positions = torch.arange(start, len(prompt))
            return engine.kv_cache[torch.tensor(table)[positions // BLOCK_SIZE], layer, :,
                                   positions % BLOCK_SIZE].transpose(0, 1)

        torch.testing.assert_close(kv(moved, 0), kv(full, 0), atol=1e-5, rtol=1e-5)
        assert (kv(moved, 2) - kv(full, 2)).abs().max() > 1e-3
    finally:
        for table in blocks:
            engine.blocks.free(table)


def test_the_blend_recomputes_what_the_question_attends_to(llm: LLM, base) -> None:
    """recompute_by="question" carries past layer 1 the reused tokens that the prompt's own
    tokens attend to most past layer 1. With the cache holding full prefill's KV (the reused
    KV exact), that is transformers' own attention: weights averaged over heads and own tokens,
    summed over layers 2 and 3, top quarter of the documents' tokens."""
    engine, hf = llm.engine, base[1]
    tokens, spans = _prompt("cab")
    n = len(tokens)
    reused = torch.zeros(n, dtype=torch.bool)
    for start, end in spans:
        reused[start:end] = True
    blocks = engine.blocks.allocate(-(-n // BLOCK_SIZE))
    try:
        blend_prefill(engine.model, engine.kv_cache, blocks, tokens, None, 1.0)  # full prefill's KV
        selected = blend_prefill(engine.model, engine.kv_cache, blocks, tokens, reused, 0.25)
    finally:
        engine.blocks.free(blocks)
    hf.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = hf(torch.tensor([tokens]), output_attentions=True).attentions  # [1, heads, n, n] each
    own = (~reused).nonzero().flatten()
    mass = sum(a[0][:, own].mean((0, 1)) for a in attentions[2:])
    rows = reused.nonzero().flatten()
    chosen = rows[mass[rows].topk(round(0.25 * len(rows))).indices]
    assert selected.tolist() == torch.cat([own, chosen]).sort().values.tolist()


def test_a_sliding_window_request_is_not_blended(llm: LLM) -> None:
    """Its blocks are never shared through the prefix cache: its documents are computed in full."""
    engine = llm.engine
    tokens, spans = _prompt("ab")
    blended = engine.num_blended_prompts
    params = SamplingParams(max_tokens=2, ignore_eos=True, streaming_window=StreamingWindow(32, 4))
    engine.add_request("window", prompt_token_ids=tokens, params=params, documents=DocumentBlend(spans, 1.0))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_blended_prompts == blended


def test_bad_spans_are_refused(llm: LLM) -> None:
    tokens, _ = _prompt("ab")
    with pytest.raises(InvalidRequestError, match="outside the prompt"):
        llm.engine.add_request("bad", prompt_token_ids=tokens, documents=DocumentBlend(((3, 999),)))
    with pytest.raises(InvalidRequestError, match="recompute_share"):
        llm.engine.add_request("bad", prompt_token_ids=tokens, documents=DocumentBlend(((3, 9),), 1.5))


def test_triton_kernels_blend_as_the_reference_does(model_dir) -> None:
    """The blend through the Triton kernels (on CPU under the interpreter, tests/conftest.py; on
    a GPU compiled): the tokens and log-probs of the torch reference's blend at a partial share,
    and of its full prefill at 100%."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    head, docs, question = _tokens(6, 3), [_tokens(7, 10), _tokens(8, 9)], _tokens(9, 4)
    tokens = head + docs[0] + docs[1] + question
    spans = ((3, 13), (13, 22))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=0)
    results = {}
    for kernels, shares in (("reference", (None, 0.5)), ("triton", (0.5, 1.0))):
        llm = LLM(model_dir, device=device, dtype="float32", kernels=kernels, block_size=BLOCK_SIZE,
                  max_num_batched_tokens=32, enforce_eager=True)
        for share in shares:
            documents = None if share is None else DocumentBlend(spans, share)
            llm.engine.add_request(f"{share}", prompt_token_ids=tokens, params=params, documents=documents)
            while llm.engine.has_unfinished_requests():
                for output in llm.engine.step():
                    results[kernels, share] = (output.token_ids, [e.logprob for e in output.logprobs])
        assert llm.engine.num_blended_prompts == sum(share is not None for share in shares)
    for ours, reference in ((("triton", 0.5), ("reference", 0.5)), (("triton", 1.0), ("reference", None))):
        assert results[ours][0] == results[reference][0]
        assert results[ours][1] == pytest.approx(results[reference][1], abs=2e-3)
    assert results["reference", 0.5][1] != pytest.approx(results["reference", None][1], abs=1e-3)

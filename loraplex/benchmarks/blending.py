"""`loraplex bench blending`: issue 25's CacheBlend figures, through the engine's own path
(`add_request(documents=DocumentBlend(...))`, loraplex.engine.blending).

Two parts, each optional (`--parts quality,ttft`):

- **quality**, on the real model (`--model DIR`: SmolLM2-135M-Instruct imported, float32 by
  default, so that what moves is the blend and not the dtype's noise): each question's prompt
  holds 4 registered documents of `--doc-tokens` tokens (topics of Python's own documentation,
  `pydoc_data`, drawn from the first `--topics` so that they recur), in a fresh order, and asks
  about one of them. Its greedy answer at each recompute share is set against full prefill's:
  greedy agreement, ROUGE-L over tokens, the log-prob error of each answer token while the two
  agree, and the time to first token.
- **ttft**, on a Llama-3-8B shape with random weights (bf16): prompts of 4 documents of
  `--doc-tokens` tokens each (4K tokens at 1,024), time to first token of a full prefill against
  a blend at the default share with every document's KV cached, and against a blend that
  computes its documents first; the goal is a blend >= 2x faster than full prefill.

Full prefills run under a tenant of their own each, so that the prefix cache cannot hand them
another request's blocks; blends run under one tenant, whose documents' KV is computed once.

    loraplex bench blending --model DIR                     (both parts; a GPU)
    loraplex bench blending --smoke                         (a tiny model, CPU: the plumbing)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loraplex.benchmarks import synthetic
from loraplex.benchmarks.decode import _device_name, _sync
from loraplex.benchmarks.results import RESULTS, write
from loraplex.engine.blending import DEFAULT_RECOMPUTE_SHARE, DocumentBlend
from loraplex.engine.llm_engine import LLMEngine
from loraplex.types import SamplingParams

GOAL_ROUGE_L = 0.95
GOAL_TTFT_SPEEDUP = 2.0
DOCUMENTS_PER_PROMPT = 4
SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
          "<|im_end|>\n")
"""SmolLM2-Instruct's chat template's system turn."""
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, rope_scaling=None,
            bos_token_id=1, eos_token_id=2)
"""The smoke run's model (config.json overrides of the Llama-3-8B shape)."""


def lcs(a: list[int], b: list[int]) -> int:
    """Length of the longest common subsequence."""
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l(candidate: list[int], reference: list[int]) -> float:
    """ROUGE-L F1 over tokens."""
    if not candidate or not reference:
        return float(candidate == reference)
    common = lcs(candidate, reference)
    if common == 0:
        return 0.0
    precision, recall = common / len(candidate), common / len(reference)
    return 2 * precision * recall / (precision + recall)


def agreement(candidate: list[int], reference: list[int]) -> float:
    """Share of the reference's positions where the candidate has the same token."""
    if not reference:
        return float(not candidate)
    return sum(a == b for a, b in zip(candidate, reference)) / len(reference)


def logprob_errors(answer: list[int], logprobs: list[float], reference: list[int],
                   reference_logprobs: list[float]) -> list[float]:
    """|log-prob difference| of each answer token while the answers agree (and at the first
    token where they part: the same position, another choice's probability)."""
    errors = []
    for token, logprob, ref_token, ref_logprob in zip(answer, logprobs, reference, reference_logprobs):
        errors.append(abs(logprob - ref_logprob))
        if token != ref_token:
            break
    return errors


@dataclass
class Answer:
    token_ids: list[int]
    logprobs: list[float]
    ttft_s: float
    added_s: float
    """Of ttft_s, the seconds add_request took (a base-model blend runs there; the rest is the
    engine's step for the prompt's last tokens and the first sample)."""


def ask(engine: LLMEngine, request_id: str, tokens: list[int], max_tokens: int,
        documents: DocumentBlend | None, tenant: str, ignore_eos: bool = False) -> Answer:
    """One greedy request on an idle engine, run to its end: its tokens, their log-probs and
    the seconds from add_request (where a base-model blend runs) to its first token."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=ignore_eos)
    _sync(engine.device)
    started = time.perf_counter()
    engine.add_request(request_id, prompt_token_ids=tokens, params=params, documents=documents, tenant=tenant)
    _sync(engine.device)
    added = time.perf_counter() - started
    first, output = None, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if first is None and output.token_ids:
                first = time.perf_counter() - started
    assert output is not None and output.finish_reason != "error", output
    return Answer(list(output.token_ids), [entry.logprob for entry in output.logprobs or []], first or 0.0,
                  added)


@dataclass
class Corpus:
    """Documents and how a prompt is put together around them (token ids)."""

    documents: dict[str, list[int]]
    head: list[int]
    question: Callable[[str], list[int]]
    """(The topic asked about) -> the question's tokens and the assistant turn's opening."""

    def prompt(self, names: list[str], asked: str) -> tuple[list[int], tuple[tuple[int, int], ...]]:
        tokens, spans = list(self.head), []
        for name in names:
            spans.append((len(tokens), len(tokens) + len(self.documents[name])))
            tokens += self.documents[name]
        return tokens + self.question(asked), tuple(spans)


def text_corpus(model_dir: Path, doc_tokens: int, num_topics: int) -> Corpus:
    """Python's documentation topics as documents, in SmolLM2-Instruct's chat template."""
    import pydoc_data.topics

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    topics = sorted(name for name, text in pydoc_data.topics.topics.items() if len(text) > 6 * doc_tokens)
    if len(topics) < max(num_topics, DOCUMENTS_PER_PROMPT):
        raise SystemExit(f"only {len(topics)} documentation topics hold {doc_tokens} tokens")
    documents = {name: encode(f"Document ({name}):\n" + pydoc_data.topics.topics[name])[:doc_tokens - 2]
                 + encode("\n\n") for name in topics[:num_topics]}
    return Corpus(documents, encode(SYSTEM + "<|im_start|>user\nRead these documents.\n\n"),
                  lambda asked: encode(f"In one sentence, what does the document about '{asked}' explain?"
                                       "<|im_end|>\n<|im_start|>assistant\n"))


def random_corpus(vocab_size: int, doc_tokens: int, num_topics: int, seed: int = 0) -> Corpus:
    """Random tokens as documents, for a model with random weights."""
    generator = torch.Generator().manual_seed(seed)

    def draw(n: int) -> list[int]:
        return torch.randint(10, vocab_size - 10, (n,), generator=generator).tolist()

    documents = {f"doc{i}": draw(doc_tokens) for i in range(num_topics)}
    asks = {name: draw(24) for name in documents}
    return Corpus(documents, draw(16), lambda asked: asks[asked])


def quality(engine: LLMEngine, corpus: Corpus, questions: int, shares: tuple[float, ...],
            answer_tokens: int, seed: int) -> dict[str, Any]:
    """Each question's answer at each share against full prefill's."""
    rng = random.Random(seed)
    rows = []
    for q in range(questions):
        names = rng.sample(sorted(corpus.documents), DOCUMENTS_PER_PROMPT)
        asked = rng.choice(names)
        tokens, spans = corpus.prompt(names, asked)
        full = ask(engine, f"q{q}-full", tokens, answer_tokens, None, f"full-q{q}")
        row: dict[str, Any] = {
            "question": q, "documents": names, "asked": asked, "prompt_tokens": len(tokens),
            "answer_tokens": len(full.token_ids), "full_prefill_ttft_s": round(full.ttft_s, 4), "shares": {}}
        for share in shares:
            computed = engine.num_document_prefills
            blend = ask(engine, f"q{q}-{share}", tokens, answer_tokens, DocumentBlend(spans, share), "kb")
            errors = logprob_errors(blend.token_ids, blend.logprobs, full.token_ids, full.logprobs)
            row["shares"][str(share)] = {
                "agreement": round(agreement(blend.token_ids, full.token_ids), 4),
                "rouge_l": round(rouge_l(blend.token_ids, full.token_ids), 4),
                "first_logprob_error": round(errors[0], 5) if errors else 0.0,
                "mean_logprob_error": round(sum(errors) / len(errors), 5) if errors else 0.0,
                "documents_computed": engine.num_document_prefills - computed,
                "ttft_s": round(blend.ttft_s, 4)}
        rows.append(row)
        cells = "  ".join(f"{share}: rouge-l {cell['rouge_l']:.2f} agree {cell['agreement']:.2f} "
                          f"{cell['ttft_s'] * 1e3:.1f} ms" for share, cell in row["shares"].items())
        print(f"question {q:3d}  {len(tokens)} prompt tokens  full {full.ttft_s * 1e3:8.1f} ms  {cells}",
              flush=True)
    summary: dict[str, Any] = {}
    for share in shares:
        cells = [row["shares"][str(share)] for row in rows]
        cached = [c["ttft_s"] for c in cells if c["documents_computed"] == 0]
        summary[str(share)] = {
            "mean_rouge_l": round(statistics.fmean(c["rouge_l"] for c in cells), 4),
            "mean_agreement": round(statistics.fmean(c["agreement"] for c in cells), 4),
            "identical_answers": sum(c["rouge_l"] == 1.0 and c["agreement"] == 1.0 for c in cells),
            "mean_first_logprob_error": round(statistics.fmean(c["first_logprob_error"] for c in cells), 5),
            "mean_logprob_error": round(statistics.fmean(c["mean_logprob_error"] for c in cells), 5),
            "median_ttft_s_documents_cached": round(statistics.median(cached), 4) if cached else None}
    full_ttft = statistics.median(r["full_prefill_ttft_s"] for r in rows)
    summary["full_prefill"] = {"median_ttft_s": round(full_ttft, 4)}
    return {"questions": questions, "summary": summary, "rows": rows,
            "mean_prompt_tokens": round(statistics.fmean(r["prompt_tokens"] for r in rows))}


def ttft(engine: LLMEngine, corpus: Corpus, reps: int, share: float, seed: int) -> dict[str, Any]:
    """Time to first token of one request alone: full prefill, a blend with its documents
    cached, and a blend that computes them first (after a warm-up of each)."""
    rng = random.Random(seed)
    times: dict[str, list[float]] = {"full_prefill": [], "blend_documents_cached": [],
                                     "blend_documents_computed": []}
    blend_s: list[float] = []  # of the cached blend's time to first token, add_request's (the blend)
    prompt_tokens = 0
    for rep in range(-1, reps):  # rep -1: the warm-up (kernels' first compile, the allocator)
        names = rng.sample(sorted(corpus.documents), DOCUMENTS_PER_PROMPT)
        tokens, spans = corpus.prompt(names, names[0])
        prompt_tokens = len(tokens)
        engine.blocks.reset_prefix_cache()  # no document's KV is cached
        blend = DocumentBlend(spans, share)
        cold = ask(engine, f"t{rep}-cold", tokens, 1, blend, "kb", True)
        full = ask(engine, f"t{rep}-full", tokens, 1, None, f"full-t{rep}", True)
        warm = ask(engine, f"t{rep}-warm", tokens, 1, blend, "kb", True)
        measured = {"blend_documents_computed": cold.ttft_s, "full_prefill": full.ttft_s,
                    "blend_documents_cached": warm.ttft_s}
        if rep >= 0:
            for name, seconds in measured.items():
                times[name].append(seconds)
            blend_s.append(warm.added_s)
            print(f"rep {rep:2d}  {len(tokens)} tokens  " + "  ".join(
                f"{name} {seconds * 1e3:8.1f} ms" for name, seconds in measured.items()), flush=True)
    medians = {name: round(statistics.median(values), 5) for name, values in times.items()}
    speedup = medians["full_prefill"] / medians["blend_documents_cached"]
    print(f"ttft at {prompt_tokens} prompt tokens: full prefill {medians['full_prefill'] * 1e3:.1f} ms, "
          f"blend (documents cached) {medians['blend_documents_cached'] * 1e3:.1f} ms, of which the blend "
          f"{statistics.median(blend_s) * 1e3:.1f} ms: {speedup:.2f}x "
          f"(goal >= {GOAL_TTFT_SPEEDUP}x)", flush=True)
    return {"reps": reps, "share": share, "prompt_tokens": prompt_tokens, "median_ttft_s": medians,
            "speedup_documents_cached": round(speedup, 3),
            "speedup_documents_computed": round(
                medians["full_prefill"] / medians["blend_documents_computed"], 3),
            "median_blend_s_documents_cached": round(statistics.median(blend_s), 5),
            "times_s": {name: [round(t, 5) for t in values] for name, values in times.items()}}


def make_engine(model: str | Path, device: str, dtype: str, max_len: int,
                overrides: dict | None) -> LLMEngine:
    """The real model from its folder (`overrides` None), else a random Llama of the 8B shape
    with `overrides`; a prefix cache with room for a prompt's documents twice over."""
    from loraplex import LLM

    blocks = 4 * -(-max_len // 16) + 64
    if overrides is None:
        return LLM(model, device=device, dtype=dtype, block_size=16, max_model_len=max_len,
                   max_num_batched_tokens=max(8192, max_len), num_kv_blocks=blocks).engine
    from loraplex.engine_config import CacheConfig, EngineConfig, SchedulerConfig
    from loraplex.kernels import engine_ops

    config = synthetic.model_config(overrides)
    torch_device, torch_dtype = torch.device(device), getattr(torch, dtype)
    weights = synthetic.random_model(config, engine_ops(torch_device), torch_dtype, torch_device, max_len,
                                     scaled_residual=True)
    return LLMEngine(EngineConfig(
        model="synthetic-llama-3-8b", device=device, dtype=dtype, max_model_len=max_len,
        cache=CacheConfig(block_size=16, num_kv_blocks=blocks),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max(8192, max_len)),
    ), model=weights)


def _shares(text: str) -> tuple[float, ...]:
    return tuple(float(part) for part in text.split(",") if part.strip())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="loraplex bench blending", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="the real model's folder (SmolLM2-135M-Instruct "
                        "imported), for the quality part")
    parser.add_argument("--parts", default="quality,ttft")
    parser.add_argument("--questions", type=int, default=50)
    parser.add_argument("--doc-tokens", type=int, default=1024)
    parser.add_argument("--topics", type=int, default=8, help="documents drawn from this many (they recur)")
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--shares", type=_shares, default=(0.0, DEFAULT_RECOMPUTE_SHARE, 1.0))
    parser.add_argument("--quality-dtype", default="float32")
    parser.add_argument("--ttft-dtype", default="bfloat16")
    parser.add_argument("--ttft-reps", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny random model on the CPU, random documents")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    parts = {part.strip() for part in args.parts.split(",") if part.strip()}
    if not parts <= {"quality", "ttft"}:
        parser.error(f"--parts takes quality and ttft, got {args.parts!r}")
    if "quality" in parts and args.model is None and not args.smoke:
        parser.error("the quality part needs --model (the real model's folder) or --smoke")
    prompt_len = DOCUMENTS_PER_PROMPT * args.doc_tokens + 64
    max_len = prompt_len + args.answer_tokens + 8
    device = "cpu" if args.device == "cpu" else _device_name(torch.device(args.device))
    result: dict[str, Any] = {
        "benchmark": "blending", "device": device, "torch": torch.__version__, "doc_tokens": args.doc_tokens,
        "documents_per_prompt": DOCUMENTS_PER_PROMPT, "default_share": DEFAULT_RECOMPUTE_SHARE,
        "goals": {"rouge_l": GOAL_ROUGE_L, "ttft_speedup": GOAL_TTFT_SPEEDUP}}
    if "quality" in parts:
        if args.smoke:
            engine = make_engine("tiny", args.device, "float32", max_len, TINY)
            corpus = random_corpus(TINY["vocab_size"], args.doc_tokens, args.topics, args.seed)
        else:
            engine = make_engine(args.model, args.device, args.quality_dtype, max_len, None)
            corpus = text_corpus(args.model, args.doc_tokens, args.topics)
        started = time.perf_counter()
        measured = quality(engine, corpus, args.questions, args.shares, args.answer_tokens, args.seed)
        result["quality"] = {"model": "tiny random" if args.smoke else args.model.name,
                             "dtype": "float32" if args.smoke else args.quality_dtype,
                             "shares": list(args.shares), **measured,
                             "seconds": round(time.perf_counter() - started, 1)}
        print(f"quality: {result['quality']['summary']}", flush=True)
        del engine
    if "ttft" in parts:
        overrides = TINY if args.smoke else {}
        dtype = "float32" if args.smoke else args.ttft_dtype
        engine = make_engine("synthetic", args.device, dtype, max_len, overrides)
        corpus = random_corpus(engine.model_config.vocab_size, args.doc_tokens, 2 * DOCUMENTS_PER_PROMPT,
                               args.seed)
        measured = ttft(engine, corpus, args.ttft_reps, DEFAULT_RECOMPUTE_SHARE, args.seed)
        result["ttft"] = {"model": "tiny random" if args.smoke else "llama-3-8b shape, random weights",
                          "dtype": dtype, **measured}
    path = write(result, args.out, "blending")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

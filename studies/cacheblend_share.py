"""How many tokens must CacheBlend recompute on our real model? (issue 25, registered documents
reused anywhere in a prompt)

CacheBlend reuses each document's KV, computed once on its own (positions from 0), wherever the
document lands in a prompt: the keys are re-positioned (rotated on by the document's offset: a
rotary rotation composes with another), and since a document's KV computed alone misses its
attention to what precedes it, the tokens whose KV deviates most from a full prefill are
computed again. As CacheBlend does: the first layer runs every token (its KV then is exact
anyway: a layer-0 key depends on the token and its position only), the second layer's KV of
every token is set against the reused one, the `share` of document tokens that deviate most
(with the prompt's own tokens: its template and the question) go through the remaining layers,
their KV replacing the reused one, attending to the blended cache.

This study runs it on SmolLM2-135M-Instruct (the quick start's model, float32, CPU), four
Python documentation topics as documents in shuffled orders and a question about one of them,
and compares each share's greedy answer with full prefill's: greedy agreement of the answer
tokens, ROUGE-L (longest common subsequence of tokens), and the first answer token's log-prob.
A share of 1.0 must equal full prefill (the check of the machinery).

    python studies/cacheblend_share.py [--model DIR] [--questions 20] [--doc-tokens 512]

With `--engine`, the same prompts go through the engine's own blending path
(loraplex.engine.blending, `add_request(documents=...)`, the torch reference ops) instead of this
file's loop: each document's KV computed once and found again in the prefix cache, every
question in a fresh order, each share's answer set against the engine's full prefill (greedy
agreement, ROUGE-L, the log-prob error of each answer token while the answers agree) and the
time to first token on this CPU (results/cacheblend-engine-cpu.json).

    python studies/cacheblend_share.py --engine [--model DIR] [--questions 6] [--doc-tokens 384]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from loraplex.benchmarks.blending import SYSTEM, agreement, logprob_errors, rouge_l  # noqa: F401 (cacheblend_select's too)

SHARES = (0.0, 0.05, 0.10, 0.15, 0.20, 0.30, 1.0)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Blender:
    """A Llama model's layers run on chosen tokens against a KV cache (HF's weights, our loop)."""

    def __init__(self, model) -> None:
        self.model = model.eval()
        cfg = model.config
        self.layers = model.model.layers
        self.num_heads, self.num_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rotary scaling {rope['rope_type']!r} is not modelled here")
        theta = rope.get("rope_theta") or cfg.rope_theta
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64)
                                                  / self.head_dim))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(torch.float32), emb.sin().to(torch.float32)

    def shift(self, keys: torch.Tensor, offset: int) -> torch.Tensor:
        """Keys [layers, tokens, kv_heads, head_dim] rotated on by `offset` positions."""
        cos, sin = self.cos_sin(torch.full((keys.shape[1],), offset))
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
        return keys * cos + rotate_half(keys) * sin

    def layer(self, index: int, hidden: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
              keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Layer `index` on `hidden` (the tokens at cache rows `rows`, positions `positions`):
        writes their KV into keys/values [tokens, kv_heads, head_dim] and attends causally (by
        position) over the whole cache; returns their next hidden states."""
        layer = self.layers[index]
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        n = x.shape[0]
        q = attn.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(n, self.num_kv, self.head_dim)
        v = attn.v_proj(x).view(n, self.num_kv, self.head_dim)
        cos, sin = self.cos_sin(positions)
        cos, sin = cos[:, None, :], sin[:, None, :]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        keys[rows], values[rows] = k, v
        group = self.num_heads // self.num_kv
        kk = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, tokens, dim]
        vv = values.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.einsum("qhd,hkd->hqk", q, kk) / self.head_dim ** 0.5
        key_positions = torch.arange(keys.shape[0])  # the cache's rows are the prompt's positions
        scores = scores.masked_fill(key_positions[None, None, :] > positions[None, :, None], float("-inf"))
        out = torch.einsum("hqk,hkd->qhd", scores.softmax(-1), vv).reshape(n, -1)
        hidden = hidden + attn.o_proj(out)
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(hidden))

    def empty_cache(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (len(self.layers), num_tokens, self.num_kv, self.head_dim)
        return torch.zeros(shape), torch.zeros(shape)

    @torch.no_grad()
    def prefill(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every token through every layer: (keys, values, last hidden state)."""
        keys, values = self.empty_cache(len(tokens))
        rows = torch.arange(len(tokens))
        hidden = self.model.model.embed_tokens(torch.tensor(tokens))
        for i in range(len(self.layers)):
            hidden = self.layer(i, hidden, rows, rows, keys[i], values[i])
        return keys, values, hidden[-1:]

    @torch.no_grad()
    def blend(self, tokens: list[int], reused: dict[int, tuple[torch.Tensor, torch.Tensor]],
              share: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """`reused`: start position -> a document's (keys, values) computed alone. Returns the
        blended cache, the last token's hidden state and how many tokens went past layer 1."""
        n = len(tokens)
        keys, values = self.empty_cache(n)
        from_docs = torch.zeros(n, dtype=torch.bool)
        for start, (k, v) in reused.items():
            end = start + k.shape[1]
            keys[:, start:end], values[:, start:end] = self.shift(k, start), v
            from_docs[start:end] = True
        rows = torch.arange(n)
        hidden = self.model.model.embed_tokens(torch.tensor(tokens))
        hidden = self.layer(0, hidden, rows, rows, keys[0], values[0])  # exact for every token
        # Layer 1's KV of every token, set against the reused one: the deviation picks the tokens.
        k1, v1 = keys[1].clone(), values[1].clone()
        probe_k, probe_v = k1.clone(), v1.clone()
        self.layer(1, hidden, rows, rows, probe_k, probe_v)
        deviation = ((probe_k - k1).pow(2).sum((1, 2)) + (probe_v - v1).pow(2).sum((1, 2)))
        doc_rows = from_docs.nonzero().flatten()
        count = round(share * len(doc_rows))
        chosen = doc_rows[deviation[doc_rows].topk(count).indices] if count else doc_rows[:0]
        selected = torch.cat([(~from_docs).nonzero().flatten(), chosen]).sort().values
        keys[1][selected], values[1][selected] = probe_k[selected], probe_v[selected]
        hidden = self.layer(1, hidden[selected], selected, selected, keys[1], values[1])
        for i in range(2, len(self.layers)):
            hidden = self.layer(i, hidden, selected, selected, keys[i], values[i])
        return keys, values, hidden[-1:], len(selected)

    @torch.no_grad()
    def generate(self, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor,
                 max_tokens: int, stop: int) -> tuple[list[int], float]:
        """Greedy answer from a prefilled cache: (tokens, the first token's log-prob)."""
        answer, first_logprob = [], 0.0
        for step in range(max_tokens):
            logprobs = F.log_softmax(self.logits(hidden)[0], -1)
            token = int(logprobs.argmax())
            if step == 0:
                first_logprob = float(logprobs[token])
            if token == stop:
                break
            answer.append(token)
            position = keys.shape[1]
            new_k, new_v = self.empty_cache(1)
            keys, values = torch.cat([keys, new_k], 1), torch.cat([values, new_v], 1)
            hidden = self.model.model.embed_tokens(torch.tensor([token]))
            row = torch.tensor([position])
            for i in range(len(self.layers)):
                hidden = self.layer(i, hidden, row, row, keys[i], values[i])
        return answer, first_logprob


ENGINE_SHARES = (0.0, 0.2, 1.0)


def run_engine_request(llm, request_id: str, tokens: list[int], documents, max_tokens: int
                       ) -> tuple[list[int], list[float], float]:
    """(answer tokens, their log-probs, seconds to the first token) of one greedy request."""
    from loraplex import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0)
    started = time.perf_counter()
    llm.engine.add_request(request_id, prompt_token_ids=tokens, params=params, documents=documents)
    first, output = None, None
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            if first is None and output.token_ids:
                first = time.perf_counter() - started
    return list(output.token_ids), [entry.logprob for entry in output.logprobs], first


def engine_study(args, folder: Path, tokenizer, encode, documents: dict[str, list[int]],
                 topics: list[str]) -> dict:
    """The prompts of `main` through the engine's blending path."""
    from loraplex import LLM
    from loraplex.engine.blending import DocumentBlend

    llm = LLM(folder, device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=4096,
              max_model_len=4096, num_kv_blocks=2048)
    rng = random.Random(1)
    head = encode(SYSTEM + "<|im_start|>user\nRead these documents.\n\n")
    rows, started = [], time.perf_counter()
    for q in range(args.questions):
        names = rng.sample(topics[:args.topics], 4)
        asked = rng.choice(names)
        tokens, spans = list(head), []
        for name in names:
            spans.append((len(tokens), len(tokens) + len(documents[name])))
            tokens += documents[name]
        tokens += encode(f"In one sentence, what does the document about '{asked}' explain?<|im_end|>\n"
                         "<|im_start|>assistant\n")
        reference, reference_logprobs, full_ttft = run_engine_request(
            llm, f"q{q}-full", tokens, None, args.answer_tokens)
        row = {"question": q, "documents": names, "asked": asked, "prompt_tokens": len(tokens),
               "reference": tokenizer.decode(reference), "full_prefill_ttft_s": round(full_ttft, 3),
               "shares": {}}
        for share in ENGINE_SHARES:
            computed, reused = llm.engine.num_document_prefills, llm.engine.num_blend_reused_tokens
            blend = DocumentBlend(tuple(spans), share)
            answer, logprobs, ttft = run_engine_request(llm, f"q{q}-{share}", tokens, blend,
                                                        args.answer_tokens)
            errors = logprob_errors(answer, logprobs, reference, reference_logprobs)
            row["shares"][str(share)] = {
                "agreement": round(agreement(answer, reference), 4),
                "rouge_l": round(rouge_l(answer, reference), 4),
                "first_logprob_error": round(errors[0], 5) if errors else None,
                "mean_logprob_error": round(sum(errors) / len(errors), 5) if errors else None,
                "documents_computed": llm.engine.num_document_prefills - computed,
                "reused_tokens": llm.engine.num_blend_reused_tokens - reused,
                "ttft_s": round(ttft, 3), "answer": tokenizer.decode(answer)}
        rows.append(row)
        scores = {share: (c["agreement"], c["rouge_l"], c["ttft_s"]) for share, c in row["shares"].items()}
        print(json.dumps({"question": q, "full_ttft_s": row["full_prefill_ttft_s"], **scores}), flush=True)
    summary = {}
    for share in ENGINE_SHARES:
        cells = [row["shares"][str(share)] for row in rows]
        warm = [c for c in cells if c["documents_computed"] == 0]  # every document found cached
        summary[str(share)] = {
            "mean_agreement": round(sum(c["agreement"] for c in cells) / len(cells), 4),
            "mean_rouge_l": round(sum(c["rouge_l"] for c in cells) / len(cells), 4),
            "exact_answers": sum(c["agreement"] == 1.0 and c["rouge_l"] == 1.0 for c in cells),
            "mean_first_logprob_error": round(sum(c["first_logprob_error"] for c in cells) / len(cells), 5),
            "mean_logprob_error": round(sum(c["mean_logprob_error"] for c in cells) / len(cells), 5),
            "mean_ttft_s_documents_cached": round(sum(c["ttft_s"] for c in warm) / len(warm), 3)
            if warm else None,
            "mean_reused_tokens": round(sum(c["reused_tokens"] for c in cells) / len(cells), 1)}
    full_ttft = sum(r["full_prefill_ttft_s"] for r in rows) / len(rows)
    summary["full_prefill"] = {"mean_ttft_s": round(full_ttft, 3)}
    return {"study": "cacheblend-engine", "model": str(folder.name), "dtype": "float32", "device": "cpu",
            "kernels": "reference", "questions": args.questions, "topics": args.topics,
            "doc_tokens": args.doc_tokens, "answer_tokens": args.answer_tokens,
            "documents_computed": llm.engine.num_document_prefills,
            "seconds": round(time.perf_counter() - started, 1), "summary": summary, "rows": rows}


def main() -> None:
    import pydoc_data.topics

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="SmolLM2-135M-Instruct's folder (default: the quick start's, built if missing)")
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None,
                        help="default: studies/results/cacheblend-share-cpu.json "
                        "(--engine: cacheblend-engine-cpu.json)")
    parser.add_argument("--engine", action="store_true", help="through the engine's blending path")
    parser.add_argument("--topics", type=int, default=8,
                        help="--engine: documents drawn from the first this many topics (so that they recur)")
    args = parser.parse_args()
    if args.out is None:
        args.out = Path("studies/results") / ("cacheblend-engine-cpu.json" if args.engine
                                              else "cacheblend-share-cpu.json")
    folder = args.model
    if folder is None:
        from loraplex.quickstart import ensure_quickstart

        folder = ensure_quickstart(Path.home() / ".loraplex").model_dir
    torch.manual_seed(0)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    topics = sorted(name for name, text in pydoc_data.topics.topics.items() if len(text) > 3000)
    documents = {name: encode(f"Document ({name}):\n" + pydoc_data.topics.topics[name])[:args.doc_tokens]
                 + encode("\n\n") for name in topics}
    if args.engine:
        result = engine_study(args, folder, tokenizer, encode, documents, topics)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result["summary"], indent=1))
        print(f"wrote {args.out}")
        return
    blender = Blender(AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32))
    alone = {}  # each document's KV computed once, on its own
    rng = random.Random(0)
    head = encode(SYSTEM + "<|im_start|>user\nRead these documents.\n\n")
    stop = tokenizer.token_to_id("<|im_end|>")
    rows, started = [], time.perf_counter()
    for q in range(args.questions):
        names = rng.sample(topics, 4)
        asked = rng.choice(names)
        question = encode(f"In one sentence, what does the document about '{asked}' explain?<|im_end|>\n"
                          "<|im_start|>assistant\n")
        tokens, reused = list(head), {}
        for name in names:
            if name not in alone:
                keys, values, _ = blender.prefill(documents[name])
                alone[name] = (keys, values)
            reused[len(tokens)] = alone[name]
            tokens += documents[name]
        tokens += question
        keys, values, hidden = blender.prefill(tokens)
        reference, reference_logprob = blender.generate(keys, values, hidden, args.answer_tokens, stop)
        row = {"question": q, "documents": names, "asked": asked, "prompt_tokens": len(tokens),
               "reference": tokenizer.decode(reference), "shares": {}}
        for share in SHARES:
            keys, values, hidden, computed = blender.blend(tokens, reused, share)
            answer, logprob = blender.generate(keys, values, hidden, args.answer_tokens, stop)
            row["shares"][str(share)] = {
                "tokens_past_layer_1": computed, "agreement": round(agreement(answer, reference), 4),
                "rouge_l": round(rouge_l(answer, reference), 4),
                "first_logprob_error": round(abs(logprob - reference_logprob), 5),
                "answer": tokenizer.decode(answer)}
        rows.append(row)
        scores = {share: (cell["agreement"], cell["rouge_l"]) for share, cell in row["shares"].items()}
        print(json.dumps({"question": q, **scores}),
              flush=True)
    summary = {}
    for share in SHARES:
        cells = [row["shares"][str(share)] for row in rows]
        summary[str(share)] = {
            "mean_agreement": round(sum(c["agreement"] for c in cells) / len(cells), 4),
            "mean_rouge_l": round(sum(c["rouge_l"] for c in cells) / len(cells), 4),
            "exact_answers": sum(c["agreement"] == 1.0 and c["rouge_l"] == 1.0 for c in cells),
            "mean_first_logprob_error": round(sum(c["first_logprob_error"] for c in cells) / len(cells), 5)}
    result = {"study": "cacheblend-share", "model": str(folder.name), "dtype": "float32", "device": "cpu",
              "questions": args.questions, "doc_tokens": args.doc_tokens, "answer_tokens": args.answer_tokens,
              "seconds": round(time.perf_counter() - started, 1), "summary": summary, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

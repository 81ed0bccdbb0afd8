"""xgrammar vs llguidance on our tokenizer (issue 24): compile 20 JSON schemas (cold: a fresh
compiler each, no cache) and time each token mask's fill along a valid answer. CPU only.

    python scripts/compare-grammar-engines.py TOKENIZER_FOLDER
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from transformers import AutoTokenizer


def schemas() -> list[dict]:
    """20 schemas of the kinds tenants send: flat records, nested objects, arrays, enums, ranges."""
    out = []
    for i in range(20):
        types = ["string", "integer", "number", "boolean"]
        props = {f"field_{j}": {"type": types[j % 4]} for j in range(3 + i % 7)}
        props["kind"] = {"enum": [f"k{m}" for m in range(2 + i % 5)]}
        if i % 3 == 0:
            props["items"] = {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 20},
                "qty": {"type": "integer", "minimum": 0}},
                "required": ["name", "qty"]}, "maxItems": 5}
        if i % 4 == 1:
            props["address"] = {"type": "object", "required": ["street", "zip"], "properties": {
                "street": {"type": "string"}, "zip": {"type": "string", "pattern": "[0-9]{5}"}}}
        out.append({"type": "object", "properties": props, "required": list(props),
                    "additionalProperties": False})
    return out


def answer(schema: dict) -> dict:
    """A valid instance of one of the schemas above."""
    value = {"string": "hello world", "integer": 42, "number": 3.5, "boolean": True}
    out = {}
    for key, prop in schema["properties"].items():
        if "enum" in prop:
            out[key] = prop["enum"][0]
        elif prop.get("type") == "array":
            out[key] = [{"name": "widget", "qty": 3}]
        elif prop.get("type") == "object":
            out[key] = {"street": "1 Main St", "zip": "12345"}
        else:
            out[key] = value[prop["type"]]
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


Cases = list[tuple[str, list[int]]]
"""(schema as JSON text, the tokens of a valid answer and the end token)."""
Timings = tuple[list[float], list[float]]
"""(compile seconds per schema, mask-fill seconds per token)."""


def run_xgrammar(tokenizer, vocab_size: int, cases: Cases) -> Timings:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=[tokenizer.eos_token_id])
    compile_s, fill_s = [], []
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    for schema, tokens in cases:
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        started = time.perf_counter()
        compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
        compile_s.append(time.perf_counter() - started)
        matcher = xgr.GrammarMatcher(compiled)
        for token in tokens:
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            fill_s.append(time.perf_counter() - started)
            assert matcher.accept_token(token), "xgrammar refused a valid answer"
    return compile_s, fill_s


def run_llguidance(tokenizer, vocab_size: int, cases: Cases) -> Timings:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    compile_s, fill_s = [], []
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
    for schema, tokens in cases:
        started = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
        matcher = llguidance.LLMatcher(lltok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        compile_s.append(time.perf_counter() - started)
        for token in tokens:
            started = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            fill_s.append(time.perf_counter() - started)
            assert matcher.consume_token(token), f"llguidance refused a valid answer: {matcher.get_error()}"
    return compile_s, fill_s


def main() -> None:
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    vocab_size = len(tokenizer)
    cases = []
    for schema in schemas():
        text = json.dumps(answer(schema), separators=(",", ":"))
        tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        cases.append((json.dumps(schema), tokens))
    for name, run in (("xgrammar", run_xgrammar), ("llguidance", run_llguidance)):
        compile_s, fill_s = run(tokenizer, vocab_size, cases)
        print(f"{name}: compile p50 {statistics.median(compile_s) * 1e3:.1f} ms, "
              f"p99 {pct(compile_s, .99) * 1e3:.1f} ms, total {sum(compile_s):.2f} s; "
              f"mask fill per token p50 {statistics.median(fill_s) * 1e6:.0f} us, "
              f"p99 {pct(fill_s, .99) * 1e6:.0f} us, mean {statistics.mean(fill_s) * 1e6:.0f} us "
              f"({len(fill_s)} tokens)")


if __name__ == "__main__":
    main()

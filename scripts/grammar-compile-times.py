"""Compile times of structured-output constraints through loraplex's GrammarCompiler (xgrammar):
100 distinct JSON schemas compiled cold, then the same 100 again (cached by content). CPU work,
wherever the engine runs.

    python scripts/grammar-compile-times.py TOKENIZER_FOLDER
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from loraplex.engine.grammar import GrammarCompiler
from loraplex.types import StructuredOutput

HERE = Path(__file__).parent


def schemas(count: int) -> list[dict]:
    """`count` distinct schemas: compare-grammar-engines.py's 20 kinds, each with a field renamed."""
    spec = importlib.util.spec_from_file_location("compare", HERE / "compare-grammar-engines.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    base = compare.schemas()
    out = []
    for i in range(count):
        schema = json.loads(json.dumps(base[i % len(base)]))
        schema["properties"][f"extra_{i}"] = {"type": "string", "pattern": "[a-z]{1,12}"}
        schema["required"].append(f"extra_{i}")
        out.append(schema)
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    specs = [StructuredOutput(json_schema=json.dumps(s)) for s in schemas(100)]
    for label in ("cold", "cached"):
        times = []
        for spec in specs:
            started = time.perf_counter()
            compiler.compile(spec)
            times.append(time.perf_counter() - started)
        print(f"{label}: p50 {statistics.median(times) * 1e3:.2f} ms, p99 {pct(times, .99) * 1e3:.2f} ms, "
              f"max {max(times) * 1e3:.2f} ms ({len(times)} schemas)")


if __name__ == "__main__":
    main()

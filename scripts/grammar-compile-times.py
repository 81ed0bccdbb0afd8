"""Compile times of structured-output constraints through loraplex's GrammarCompiler (xgrammar):
100 distinct JSON schemas compiled cold, then the same 100 again (cached by content). CPU work,
wherever the engine runs, so the figures are the host's: the CPU is recorded beside them.

    python scripts/grammar-compile-times.py TOKENIZER_FOLDER [--out FILE.json]
    python scripts/grammar-compile-times.py --synthetic-vocab 128256 [--out FILE.json]

A tokenizer folder is a Hugging Face one (tokenizer.json; scripts/gpu-structured.sh carries
SmolLM2's to the GPU machine); `--synthetic-vocab N` uses `loraplex bench structured`'s synthetic
vocabulary of N tokens instead. Needs xgrammar (and transformers for a tokenizer folder); says so
and exits 2 without it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from loraplex.benchmarks.results import code_commit
from loraplex.benchmarks.structured import synthetic_vocab, xgrammar_missing

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


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_compiler(args: argparse.Namespace):
    import xgrammar

    from loraplex.engine.grammar import GrammarCompiler

    if args.synthetic_vocab:
        size = args.synthetic_vocab
        info = xgrammar.TokenizerInfo(synthetic_vocab(size, [size - 1]), vocab_size=size,
                                      stop_token_ids=[size - 1])
        return GrammarCompiler(None, size, [size - 1], tokenizer_info=info), f"synthetic ({size} tokens)"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id]), args.tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tokenizer", nargs="?", default="", help="a Hugging Face tokenizer folder")
    parser.add_argument("--synthetic-vocab", type=int, default=0, metavar="N")
    parser.add_argument("--num-schemas", type=int, default=100)
    parser.add_argument("--out", type=Path, help="also write the figures here as JSON")
    args = parser.parse_args(argv)
    if bool(args.tokenizer) == bool(args.synthetic_vocab):
        parser.error("give a tokenizer folder or --synthetic-vocab N (one of them)")
    if (missing := xgrammar_missing()) is not None:
        print(missing, flush=True)
        return 2
    compiler, vocabulary = make_compiler(args)
    from loraplex.types import StructuredOutput

    specs = [StructuredOutput(json_schema=json.dumps(s)) for s in schemas(args.num_schemas)]
    figures = {}
    for label in ("cold", "cached"):
        times = []
        for spec in specs:
            started = time.perf_counter()
            compiler.compile(spec)
            times.append(time.perf_counter() - started)
        figures[label] = {"p50_ms": statistics.median(times) * 1e3, "p99_ms": pct(times, .99) * 1e3,
                          "max_ms": max(times) * 1e3, "num_schemas": len(times)}
        print(f"{label}: p50 {figures[label]['p50_ms']:.2f} ms, p99 {figures[label]['p99_ms']:.2f} ms, "
              f"max {figures[label]['max_ms']:.2f} ms ({len(times)} schemas)", flush=True)
    if args.out:
        from importlib.metadata import version

        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "benchmark": "grammar-compile-times", "cpu": cpu_name(), "vocabulary": vocabulary,
            "xgrammar": version("xgrammar"), "commit": code_commit(), **figures}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Structured outputs' cost on the decode step: a decode step of `--batch` requests (64), half
of them constrained by `--num-schemas` (8) different JSON schemas, against the same requests
unconstrained, on a Llama-3-8B-shaped model with random weights (or a tiny one on CPU), the
requests spread over `--num-adapters` random LoRA adapters. Each run times `--steps` decode
steps in steady state (every request decoding, none finished; async scheduling on CUDA, so a
step's period is what the device and the host leave between them), and the constrained run
also the host's time filling the masks (overlapped with the device's forward pass) and the
device's time drawing the masked rows again; `--repeats` runs of each, interleaved, the median
run reported. Goal (issue 24): the constrained step <= 1.05x the
unconstrained one on an H100.

    loraplex bench structured [--batch 64] [--num-schemas 8] [--steps 32] [--prompt-len 512]
        [--num-adapters 8] [--tokenizer FOLDER] [--model-overrides JSON] [--device cuda]
        [--out DIR]

The grammars need a vocabulary: without `--tokenizer` (a Hugging Face tokenizer folder) a
synthetic one of the model's size (every byte, then random strings of 2 to 8 characters of a
JSON-like alphabet, the engine's eos as the stop token). Needs xgrammar (`pip install
xgrammar`; on a bare GPU machine, from carried wheels: scripts/gpu-structured.sh)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import string
import time
from pathlib import Path
from typing import Any

import torch

from loraplex.benchmarks import decode, device_floors, results, synthetic
from loraplex.engine.llm_engine import LLMEngine
from loraplex.kernels import engine_ops
from loraplex.types import SamplingParams, StructuredOutput

ALPHABET = string.ascii_letters + string.digits + ' {}[]":,.-_'
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
         "kilo", "lima", "mike", "november", "oscar", "papa"]


def xgrammar_missing() -> str | None:
    """Why structured outputs cannot run here (None: they can)."""
    if importlib.util.find_spec("xgrammar") is None:
        return ("xgrammar is not installed: structured outputs need it (pip install xgrammar; on a "
                "machine without an index, from carried wheels: pip install --no-index --find-links "
                "wheels xgrammar, as scripts/gpu-structured.sh does)")
    return None


def schemas(count: int) -> list[dict]:
    """`count` different JSON schemas whose answers take well over 100 tokens (so that no
    constrained request ends inside the timed steps): an id of 40 letters, 40 tags from a
    schema's own words, 40 scores, a flag, and for every other schema a nested object."""
    out = []
    for k in range(count):
        words = WORDS[k % len(WORDS):] + WORDS[:k % len(WORDS)]
        properties: dict[str, Any] = {
            f"id_{k}": {"type": "string", "pattern": "^[a-z]{40}$"},
            "tags": {"type": "array", "items": {"enum": words[:4 + k % 4]}, "minItems": 40, "maxItems": 40},
            "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                       "minItems": 40, "maxItems": 40},
            "flag": {"type": "boolean"},
        }
        if k % 2:
            properties["owner"] = {"type": "object", "properties": {
                "name": {"type": "string", "pattern": "^[A-Z][a-z]{20}$"},
                "level": {"enum": ["low", "mid", "high"]}}, "required": ["name", "level"],
                "additionalProperties": False}
        out.append({"type": "object", "properties": properties, "required": list(properties),
                    "additionalProperties": False})
    return out


def synthetic_vocab(size: int, stop_ids: list[int], seed: int = 0) -> list[bytes]:
    """`size` distinct tokens: the 256 bytes, then random strings of 2 to 8 characters of
    ALPHABET; the stop tokens are special strings."""
    generator = random.Random(seed)
    vocab = [bytes([i]) for i in range(min(256, size))]
    seen = set(vocab)
    while len(vocab) < size:
        token = "".join(generator.choices(ALPHABET, k=generator.randint(2, 8))).encode()
        if token not in seen:
            seen.add(token)
            vocab.append(token)
    for i in stop_ids:
        if i < size:
            vocab[i] = f"<|stop {i}|>".encode()
    return vocab


def tokenizer_info(args: argparse.Namespace, vocab_size: int, stop_ids: list[int]) -> Any:
    import xgrammar

    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=stop_ids)
    return xgrammar.TokenizerInfo(synthetic_vocab(vocab_size, stop_ids), vocab_size=vocab_size,
                                  stop_token_ids=stop_ids)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from loraplex.engine.grammar import GrammarCompiler

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    overrides = json.loads(args.model_overrides or "{}")
    model_config = synthetic.model_config(overrides)
    max_len = args.prompt_len + args.max_tokens + 16
    model = synthetic.random_model(model_config, engine_ops(device), dtype, device, max_len, seed=0)
    floors = device_floors.measure(args.device, args.dtype)
    config = decode.DecodeBenchConfig(batch_sizes=(args.batch,), prompt_len=args.prompt_len,
                                      new_tokens=args.max_tokens, rank=args.rank, hf_batch_sizes=(),
                                      model=overrides, device=args.device, dtype=args.dtype)
    started = time.perf_counter()
    engine = decode._engine(config, model, max_len)
    print(f"engine built in {time.perf_counter() - started:.1f} s", flush=True)
    adapters = [f"a{i}" for i in range(args.num_adapters)]
    for i, name in enumerate(adapters):
        engine.add_adapter(name, synthetic.random_adapter(model_config, args.rank, dtype, device, name,
                                                          seed=i, pin=device.type == "cuda"))
    # (a model shrunk by overrides may keep Llama-3's eos id past its vocabulary: its last token then)
    vocab_size = model_config.vocab_size
    stop_ids = sorted(i for i in engine.eos_token_ids if i < vocab_size) or [vocab_size - 1]
    started = time.perf_counter()
    compiler = GrammarCompiler(None, model_config.vocab_size, stop_ids,
                               tokenizer_info=tokenizer_info(args, model_config.vocab_size, stop_ids))
    grammars = [compiler.compile(StructuredOutput(json_schema=json.dumps(schema)))
                for schema in schemas(args.num_schemas)]
    compile_s = time.perf_counter() - started
    generator = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3, model_config.vocab_size - 3, (args.batch, args.prompt_len),
                            generator=generator).tolist()
    probe = Probe(engine)
    rows: dict[str, list[dict[str, Any]]] = {"warm-up": [], "unconstrained": [], "constrained": []}
    # interleaved, so that a drift of the machine hits both
    for label in ["warm-up"] + ["unconstrained", "constrained"] * args.repeats:
        engine.blocks.reset_prefix_cache()
        for i, prompt in enumerate(prompts):
            grammar = grammars[(i // 2) % len(grammars)] if label == "constrained" and i % 2 == 0 else None
            params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=i,
                                    ignore_eos=grammar is None,
                                    structured=grammar.spec if grammar is not None else None)
            engine.add_request(f"{label}-{i}", prompt_token_ids=prompt, params=params, grammar=grammar,
                               adapter=adapters[i % len(adapters)] if adapters else None)
        rows[label].append(_measure(engine, args, probe))
        engine.abort_all()
        print(label, json.dumps(rows[label][-1]), flush=True)
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed" not in n)
    plain, masked = _median_run(rows["unconstrained"]), _median_run(rows["constrained"])
    ratio = masked["step_ms"] / plain["step_ms"]
    return {
        "benchmark": "structured", "device": decode._device_name(device), "torch": torch.__version__,
        "xgrammar": _version("xgrammar"),
        "config": {k: str(v) for k, v in vars(args).items()},
        "vocabulary": args.tokenizer or f"synthetic ({model_config.vocab_size} tokens)",
        "floors": floors.as_dict(),
        "weights_floor_ms": round(floors.floor(weights, 0)["floor_s"] * 1e3, 3),
        "grammar_compile_s": round(compile_s, 3), "num_schemas": len(grammars),
        "unconstrained": plain, "constrained": masked, "runs": rows,
        "constrained_over_unconstrained": round(ratio, 4), "goal": "<= 1.05",
        "meets_goal": ratio <= 1.05,
    }


class Probe:
    """The constrained steps' own work, timed: the host's building of a step's masks (the
    engine's `_token_masks`: the matchers' fills) and the masked draw on the device
    (`ModelRunner.sample_masked`: the masks' copy and the masked-sampling graph, between CUDA
    events; on CPU its wall time)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.mask_fill: list[float] = []
        self.draws: list[Any] = []
        fill, draw, cuda = engine._token_masks, engine.runner.sample_masked, engine.device.type == "cuda"

        def timed_fill(plan):
            begun = time.perf_counter()
            masks = fill(plan)
            self.mask_fill.append(time.perf_counter() - begun)
            return masks

        def timed_draw(started, masks):
            if not cuda:
                begun = time.perf_counter()
                tokens = draw(started, masks)
                self.draws.append(time.perf_counter() - begun)
                return tokens
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
            tokens = draw(started, masks)
            events[1].record()
            self.draws.append(events)
            return tokens

        engine._token_masks, engine.runner.sample_masked = timed_fill, timed_draw

    def clear(self) -> None:
        self.mask_fill.clear()
        self.draws.clear()

    def per_step(self, steps: int) -> dict[str, Any]:
        """Milliseconds a step (read after a sync)."""
        draws = [d if isinstance(d, float) else d[0].elapsed_time(d[1]) / 1e3 for d in self.draws]
        return {"mask_fill_ms_per_step": round(sum(self.mask_fill) / steps * 1e3, 4),
                "mask_fill_calls": len(self.mask_fill),
                "masked_draw_ms_per_step": round(sum(draws) / steps * 1e3, 4)}


def _measure(engine: LLMEngine, args: argparse.Namespace, probe: Probe) -> dict[str, Any]:
    """Step the engine until every request decodes, then time `args.steps` steps (fewer if a
    request ends first: `steps` says how many were timed)."""
    batch, seen = args.batch, set()
    while engine.has_unfinished_requests():  # the prompts' steps, then the first tokens
        seen.update(o.request_id for o in engine.step())
        if len(seen) == batch:
            break
    for _ in range(args.warm_up_steps):
        engine.step()
    decode._sync(engine.device)
    probe.clear()
    begun, times, running = time.perf_counter(), [], []
    for _ in range(args.steps):
        outputs = engine.step()
        times.append(time.perf_counter())
        running.append(len(engine.scheduler.running))
        if any(o.finished for o in outputs):
            break
    decode._sync(engine.device)
    ended = time.perf_counter()
    steps = len(times)
    periods = [b - a for a, b in zip([begun, *times], times)]
    return {"steps": steps, "step_ms": round((ended - begun) / steps * 1e3, 4),
            "median_step_ms": round(sorted(periods)[steps // 2] * 1e3, 4),
            "min_running": min(running), **probe.per_step(steps)}


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median step time (of an odd count; the slower middle one of an even)."""
    return sorted(runs, key=lambda run: run["step_ms"])[len(runs) // 2]


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loraplex bench structured", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--num-schemas", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed")
    parser.add_argument("--warm-up-steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, interleaved (the median "
                        "run is reported)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--num-adapters", type=int, default=8, help="random LoRA adapters the requests "
                        "take in turn (0: the base model)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default="", help="a Hugging Face tokenizer folder for the "
                        "grammars' vocabulary (default: a synthetic one)")
    parser.add_argument("--model-overrides", default="", help="config.json keys replacing the "
                        "Llama-3-8B shape, as JSON (a tiny model for a CPU run)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=results.RESULTS)
    args = parser.parse_args(argv)
    if (missing := xgrammar_missing()) is not None:
        print(missing, flush=True)
        return 2
    result = run(args)
    path = results.write(result, args.out, name="structured")
    print(f"constrained / unconstrained step: {result['constrained_over_unconstrained']:.4f} "
          f"(goal {result['goal']}); written to {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

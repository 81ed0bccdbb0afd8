"""`loraplex bench BENCHMARK ...` (also `python -m loraplex.benchmarks BENCHMARK ...`, which needs
neither the registry's nor the server's packages, for bare GPU machines). Every benchmark lives
in loraplex.benchmarks and writes its results under bench/results/."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from loraplex.benchmarks.results import RESULTS, write

DEFAULT_OUT = RESULTS

SCRIPTS = {
    "kernels": ("kernel_speed", "the Triton kernels at Llama-3-8B shapes against their ceilings"),
    "relay-kernels": ("relay_kernels", "RelayAttention decode against plain paged decode: "
                      "group size x prefix length x batch, and the crossover"),
    "relay": ("relay", "tenants' shared system prompts: relay decode against the prefix cache with "
              "plain paged decode and against no sharing, next to their floors"),
    "relay-offline": ("relay_offline", "an offline batch with unregistered shared prefixes: global "
                      "prefix grouping against the prefix cache alone and against no sharing"),
    "decode-families": ("families", "decode by adapter family: LoRA, DoRA, IA3, FLoRA, mixed"),
    "load": ("server_load", "many streaming clients against `loraplex serve` on the demo"),
    "serve": ("serve_bench", "the serving benchmark: arrivals, tenants, Zipf adapters, through HTTP"),
    "fairness": ("fairness", "light tenants beside a flooding one: VTC with KV swapping against FCFS"),
    "fairness-sim": ("fairness_sim", "the fairness benchmark's workload on a virtual clock: the real "
                     "scheduler and policies, an H100 step-time model (CPU)"),
    "slots": ("slot_bench", "adapter slots on a virtual clock: the real scheduler and adapter tiers, "
              "the serving workload, an H100 step-time model (CPU)"),
    "structured": ("structured", "structured outputs' cost on the decode step: 64 requests, half "
                   "constrained by 8 JSON schemas, against the same unconstrained"),
    "tensor-parallel": ("tensor_parallel", "tensor_parallel_size 2 against 1 on a Llama-3-8B shape: the "
                        "batch-1 decode step, batch-64 throughput with 64 adapters, the collectives' time"),
    "disaggregated": ("disaggregated_bench", "disaggregated prefill and decode on two GPUs against two "
                      "colocated replicas: goodput within TTFT and TPOT targets, the KV transfers' "
                      "bandwidth"),
    "blending": ("blending", "registered documents blended into prompts (CacheBlend): answers against full "
                 "prefill on the real model, time to first token at 4K prompt tokens on a Llama-3-8B shape"),
    "placement": ("placement_bench", "where prefill and decode run for a workload's TTFT and TPOT targets: "
                  "colocated or disaggregated P:D, each one's goodput from a step-time model (CPU)"),
    "regression": ("regression", "the headline benchmarks at reduced size, each figure against the one "
                   "recorded for this device (one GPU pass, about 8 minutes: scripts/gpu-regress.sh)"),
}
"""Benchmarks with their own command line: name -> (module, summary)."""


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("bench", help="benchmarks (need a GPU)")
    add_benchmarks(parser)


def add_benchmarks(parser: argparse.ArgumentParser) -> None:
    kinds = parser.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    decode = kinds.add_parser("decode", help="multi-adapter decode on a Llama-3-8B-shaped model "
                              "against transformers + PEFT")
    decode.add_argument("--batch-sizes", type=_ints, default=(1, 8, 32, 64, 128))
    decode.add_argument("--prompt-len", type=int, default=512)
    decode.add_argument("--new-tokens", type=int, default=128)
    decode.add_argument("--rank", type=int, default=16)
    decode.add_argument("--hf-batch-sizes", type=_ints, default=(1, 8, 32))
    decode.add_argument("--hf-new-tokens", type=int, default=16)
    decode.add_argument("--hf-adapters", type=int, default=0,
                        help="distinct PEFT adapters, taken in turn by the batch's requests (default: one "
                             "per request; PEFT adds adapters slowly)")
    decode.add_argument("--profile", action="store_true",
                        help="profile a few decode steps per batch size instead of benchmarking")
    decode.add_argument("--bandwidth", type=float, default=0.0,
                        help="memory bandwidth for the floor, bytes/s (default: the device's, measured "
                             "by a copy)")
    decode.add_argument("--model", default="", metavar="FOLDER",
                        help="a model folder (as `loraplex model import` writes): its shape and weights "
                             "instead of a random Llama-3-8B")
    _common(decode)
    decode.set_defaults(run=run_decode)
    scoring = kinds.add_parser("prompt-logprobs", help="scoring prompts (echo + logprobs, max_tokens 0) "
                               "against plain prefill on a Llama-3-8B-shaped model")
    scoring.add_argument("--num-prompts", type=int, default=1000)
    scoring.add_argument("--prompt-len", type=int, default=512)
    scoring.add_argument("--top", type=int, default=1, help="top alternatives per prompt token")
    scoring.add_argument("--max-num-batched-tokens", type=int, default=8192)
    scoring.add_argument("--max-num-seqs", type=int, default=64)
    _common(scoring)
    scoring.set_defaults(run=run_prompt_logprobs)
    accuracy = kinds.add_parser("accuracy", help="the bf16 engine against its float32 reference path")
    accuracy.add_argument("--num-requests", type=int, default=64)
    accuracy.add_argument("--prompt-len", type=int, default=256)
    accuracy.add_argument("--new-tokens", type=int, default=64)
    accuracy.add_argument("--rank", type=int, default=16)
    accuracy.add_argument("--init", choices=("normal", "scaled"), default="scaled",
                          help="random weights: all N(0, 0.02), or residual projections scaled down")
    accuracy.add_argument("--model", default="", metavar="FOLDER",
                          help="a real model's folder (as `loraplex model import` writes) instead of a "
                               "random model; its prompts are the quick start's tasks in its chat template")
    accuracy.add_argument("--adapter", action="append", default=[], metavar="NAME=FOLDER",
                          help="with --model: a PEFT adapter (repeat; requests take none and each in turn)")
    _common(accuracy)
    accuracy.set_defaults(run=run_accuracy)
    for name, (module, summary) in SCRIPTS.items():
        script = kinds.add_parser(name, help=f"{summary} (its own options: {name} --help)", add_help=False)
        script.set_defaults(run=_run_script, module=module, passes_args=True)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse, handing what the parser does not know to a benchmark with its own command line
    (as `args.args`)."""
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "passes_args", False):
        args.args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _run_script(args: argparse.Namespace) -> None:
    """The benchmark's `main(argv)`; a non-zero status it returns is the process's exit status."""
    import importlib
    import sys

    status = importlib.import_module(f"loraplex.benchmarks.{args.module}").main(args.args)
    if status:
        sys.exit(status)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model-overrides", type=json.loads, default={},
                        help="JSON of config.json keys replacing the Llama-3-8B shape")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results folder (default {DEFAULT_OUT})")


def run_decode(args: argparse.Namespace) -> None:
    from loraplex.benchmarks import decode

    config = decode.DecodeBenchConfig(
        batch_sizes=args.batch_sizes, prompt_len=args.prompt_len, new_tokens=args.new_tokens, rank=args.rank,
        hf_batch_sizes=args.hf_batch_sizes, hf_new_tokens=args.hf_new_tokens,
        hf_adapters=args.hf_adapters, bandwidth=args.bandwidth,
        device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32",
        model=args.model_overrides, model_path=args.model,
    )
    if args.profile:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode-profile.txt").write_text(decode.profile(config))
        return
    path = write(decode.run(config), args.out)
    print(f"wrote {path}")
    try:
        decode.plot(path, path.with_suffix(".png"))
        print(f"wrote {path.with_suffix('.png')}")
    except ImportError:
        print("matplotlib is not installed: no plot (run `python -m loraplex.benchmarks.plot` later)")


def run_prompt_logprobs(args: argparse.Namespace) -> None:
    from loraplex.benchmarks import prompt_logprobs

    config = prompt_logprobs.PromptLogprobsBenchConfig(
        num_prompts=args.num_prompts, prompt_len=args.prompt_len, top=args.top,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32",
        model=args.model_overrides,
    )
    path = write(prompt_logprobs.run(config), args.out, name="prompt-logprobs")
    print(f"wrote {path}")


def run_accuracy(args: argparse.Namespace) -> None:
    from loraplex.benchmarks import accuracy

    adapters = {}
    for item in args.adapter:
        name, sep, folder = item.partition("=")
        if not sep or not name or not folder:
            raise SystemExit(f"--adapter takes NAME=FOLDER, not {item!r}")
        adapters[name] = folder
    if adapters and not args.model:
        raise SystemExit("--adapter needs --model (a random model gets random adapters)")
    config = accuracy.AccuracyConfig(
        num_requests=args.num_requests, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
        rank=args.rank, init=args.init, device=args.device, model=args.model_overrides,
        model_path=args.model, adapters=adapters,
    )
    result = accuracy.run(config)
    name = f"accuracy-{Path(args.model).name}" if args.model else f"accuracy-{args.init}-init"
    path = write(result, args.out, name=name)
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=2))
    print(f"wrote {path}")

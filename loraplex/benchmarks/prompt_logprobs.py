"""`loraplex bench prompt-logprobs`: what scoring prompts costs (lm-eval's likelihood requests:
`echo` + `logprobs: 1`, `max_tokens: 0`). On a Llama-3-8B-shaped model with random weights,
the same prompts are prefilled three ways: scoring every prompt token (its logprob, rank and
top alternatives), plain prefill generating nothing, and prefill sampling one token. The goal:
scoring runs at >= 80% of plain prefill's tokens per second."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from loraplex.benchmarks import synthetic
from loraplex.benchmarks.decode import _device_name, _sync
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine_config import CacheConfig, EngineConfig, SchedulerConfig
from loraplex.kernels import engine_ops
from loraplex.types import SamplingParams

GOAL = 0.80
"""Scoring throughput / plain prefill throughput to reach."""


@dataclass(frozen=True)
class PromptLogprobsBenchConfig:
    num_prompts: int = 1000
    prompt_len: int = 512
    top: int = 1
    """Top alternatives per prompt token (lm-eval asks for 1)."""
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    device: str = "cuda"
    dtype: str = "bfloat16"
    model: dict[str, Any] = field(default_factory=dict)
    """config.json overrides of the Llama-3-8B shape (a tiny model for a CPU smoke run)."""
    seed: int = 0


def modes(top: int) -> dict[str, SamplingParams]:
    """How each run treats the same prompts."""
    return {
        "score": SamplingParams(max_tokens=0, prompt_logprobs=top, logprobs=top),
        "prefill": SamplingParams(max_tokens=0),
        "prefill_sample_1": SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
    }


def run(config: PromptLogprobsBenchConfig) -> dict[str, Any]:
    device, dtype = torch.device(config.device), getattr(torch, config.dtype)
    model_config = synthetic.model_config(config.model)
    max_len = config.prompt_len + 16
    started = time.perf_counter()
    model = synthetic.random_model(model_config, engine_ops(device), dtype, device, max_len, seed=config.seed)
    engine = LLMEngine(EngineConfig(
        model="synthetic-llama-3-8b", device=config.device, dtype=config.dtype, max_model_len=max_len,
        seed=config.seed,
        cache=CacheConfig(block_size=16, num_kv_blocks=config.max_num_seqs * -(-max_len // 16) + 1),
        scheduler=SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=config.max_num_batched_tokens),
    ), model=model)
    setup_s = time.perf_counter() - started
    generator = torch.Generator().manual_seed(config.seed)
    prompts = torch.randint(1000, model_config.vocab_size - 1000, (config.num_prompts, config.prompt_len),
                            generator=generator).tolist()
    for name, params in modes(config.top).items():  # warm-up: allocator, kernels' autotuning
        _run_mode(engine, f"warm-{name}", prompts[:4], params)
    rows = {}
    for name, params in modes(config.top).items():
        seconds, outputs = _run_mode(engine, name, prompts, params)
        rows[name] = {"seconds": round(seconds, 3),
                      "prompt_tok_s": round(config.num_prompts * config.prompt_len / seconds, 1)}
        if params.prompt_logprobs is not None:
            rows[name]["scored_tokens"] = sum(len(o.prompt_logprobs) - 1 for o in outputs)
        print(f"{name:18s} {rows[name]['prompt_tok_s']:12.1f} prompt tokens/s  ({seconds:.2f} s)", flush=True)
    ratio = rows["score"]["prompt_tok_s"] / rows["prefill"]["prompt_tok_s"]
    print(f"scoring / plain prefill: {ratio:.3f} (goal >= {GOAL})", flush=True)
    return {
        "benchmark": "prompt-logprobs", "config": asdict(config), "device": _device_name(device),
        "torch": torch.__version__, "setup_s": round(setup_s, 1), "rows": rows,
        "ratio_to_prefill": round(ratio, 3),
        "ratio_to_prefill_sample_1": round(rows["score"]["prompt_tok_s"]
                                           / rows["prefill_sample_1"]["prompt_tok_s"], 3),
        "goal": GOAL,
    }


def _run_mode(engine: LLMEngine, name: str, prompts: list[list[int]], params: SamplingParams):
    """(seconds until every prompt's request finished, the final outputs)."""
    _sync(engine.device)
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{name}-{i}", prompt_token_ids=prompt, params=params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    _sync(engine.device)
    return time.perf_counter() - started, finished

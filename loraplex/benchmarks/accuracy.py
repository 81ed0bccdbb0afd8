"""`loraplex bench accuracy`: the mixed-adapter engine in bf16 (Triton kernels, CUDA graphs)
against its float32 reference path (torch reference ops, no graphs) on the same random
Llama-3-8B-shaped model and adapters.

The bf16 engine generates greedily; the float32 engine is then fed the same tokens (teacher
forcing), so every position is compared in the same context: the share of positions whose
float32 argmax is the token bf16 chose, and the relative distance of the logits."""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from loraplex.benchmarks import synthetic
from loraplex.benchmarks.decode import _device_name
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.lora_weights import HostAdapter
from loraplex.engine_config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from loraplex.kernels import select_ops
from loraplex.model.llama import LlamaForCausalLM
from loraplex.types import SamplingParams


@dataclass(frozen=True)
class AccuracyConfig:
    num_requests: int = 64
    """Each with its own adapter."""
    prompt_len: int = 256
    new_tokens: int = 64
    rank: int = 16
    init: str = "scaled"
    """"normal": every weight N(0, 0.02); "scaled": o_proj and down_proj N(0, 0.02 / sqrt(2 *
    layers)) (GPT-2's residual scaling), a better-conditioned random model."""
    device: str = "cuda"
    model: dict[str, Any] = field(default_factory=dict)
    """config.json overrides of the Llama-3-8B shape."""
    seed: int = 0


def run(config: AccuracyConfig) -> dict[str, Any]:
    device = torch.device(config.device)
    model_config = synthetic.model_config(config.model)
    max_len = config.prompt_len + config.new_tokens + 16
    started = time.perf_counter()
    model = synthetic.random_model(model_config, select_ops(device), torch.bfloat16, device, max_len,
                                   config.seed, scaled_residual=config.init == "scaled")
    adapters = [synthetic.random_adapter(model_config, config.rank, torch.bfloat16, device, str(i),
                                         seed=1000 + i, pin=False) for i in range(config.num_requests)]
    generator = torch.Generator().manual_seed(config.seed)
    prompts = torch.randint(1000, model_config.vocab_size - 1000, (config.num_requests, config.prompt_len),
                            generator=generator).tolist()
    _progress("model and adapters built", started)
    tokens, bf16_logits = _generate(config, model, adapters, prompts, "bfloat16", forced=None)
    bf16_s = time.perf_counter() - started
    _progress("bf16 engine done", started)
    hf_logits = _hf_peft_logits(model, adapters, prompts, tokens)
    _progress("transformers + PEFT bf16 done", started)
    reference = _float32_copy(model, device, max_len)
    del model
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    fp32_adapters = [_float32_adapter(a) for a in adapters]
    _, fp32_logits = _generate(config, reference, fp32_adapters, prompts, "float32", forced=tokens)
    _progress("float32 reference done", started)
    return {
        "check": "accuracy", "config": asdict(config), "device": _device_name(device),
        "torch": torch.__version__, "seconds": round(time.perf_counter() - started, 1),
        "bf16_run_seconds": round(bf16_s, 1), **compare(bf16_logits, fp32_logits),
        "transformers_peft_bf16": compare(hf_logits, fp32_logits),
    }


def _progress(what: str, started: float) -> None:
    print(f"[{time.perf_counter() - started:7.1f} s] {what}", flush=True)


def compare(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> dict[str, Any]:
    """Greedy agreement (the two argmaxes agree) and relative logit error over every (request,
    position), logits [positions, vocab] per request."""
    agree, errors = [], []
    for a, b in zip(ours, reference):
        agree.extend((a.argmax(dim=-1) == b.argmax(dim=-1)).tolist())
        errors.extend(((a - b).norm(dim=-1) / b.norm(dim=-1)).tolist())
    errors_np = np.asarray(errors)
    return {
        "positions": len(agree), "identical_greedy_fraction": round(float(np.mean(agree)), 5),
        "logits_rel_error_max": float(errors_np.max()),
        "logits_rel_error_median": float(np.median(errors_np)),
        "logits_rel_error_p99": float(np.quantile(errors_np, 0.99)),
    }


def _generate(config: AccuracyConfig, model: LlamaForCausalLM, adapters: list[HostAdapter],
              prompts: list[list[int]], dtype: str, forced: list[list[int]] | None,
              ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy generation of every prompt with its own adapter; with `forced`, the tokens fed
    back are those instead of the sampled ones. Returns (tokens, logits [new_tokens, vocab]
    float32 on the CPU) per request."""
    max_len = model.max_positions
    engine = LLMEngine(EngineConfig(
        model="synthetic-llama-3-8b", device=config.device, dtype=dtype, max_model_len=max_len,
        kernels="auto" if dtype == "bfloat16" else "reference", enforce_eager=forced is not None,
        cache=CacheConfig(num_kv_blocks=config.num_requests * -(-max_len // 16) + 1),
        scheduler=SchedulerConfig(max_num_seqs=config.num_requests, max_num_batched_tokens=4096),
        lora=LoRAConfig(max_lora_rank=config.rank, max_loras=config.num_requests),
    ), model=model)
    for i, host in enumerate(adapters):
        engine.add_adapter(f"adapter-{i}", host)
    logits: dict[str, list[torch.Tensor]] = {}
    _record_logits(engine, logits)
    if forced is not None:
        _force_tokens(engine, {f"r{i}": t for i, t in enumerate(forced)})
    params = SamplingParams(max_tokens=config.new_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=prompt, params=params, adapter=f"adapter-{i}")
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output.token_ids
    ids = [f"r{i}" for i in range(len(prompts))]
    return [outputs[r] for r in ids], [torch.stack(logits[r]) for r in ids]


@torch.no_grad()
def _hf_peft_logits(model: LlamaForCausalLM, adapters: list[HostAdapter], prompts: list[list[int]],
                    tokens: list[list[int]], chunk: int = 8) -> list[torch.Tensor]:
    """transformers + PEFT in bf16 on the same weights, adapters and tokens: the logits of every
    generated position (a baseline for what bf16 alone costs)."""
    config = model.config
    names = {f"adapter-{i}": a for i, a in enumerate(adapters)}
    peft = synthetic.add_peft_adapters(synthetic.hf_model_sharing_weights(model), names, config)
    device = model.embed_tokens.device
    new = len(tokens[0])
    logits = []
    for start in range(0, len(prompts), chunk):
        rows = range(start, min(start + chunk, len(prompts)))
        ids = torch.tensor([prompts[i] + tokens[i][:-1] for i in rows], device=device)
        out = peft(input_ids=ids, adapter_names=[f"adapter-{i}" for i in rows], logits_to_keep=new)
        logits.extend(out.logits.float().cpu())
    del peft
    return logits


def _record_logits(engine: LLMEngine, into: dict[str, list[torch.Tensor]]) -> None:
    def record(sampled_ids: list[str], logits: torch.Tensor) -> None:
        for request_id, row in zip(sampled_ids, logits.float().cpu()):
            into.setdefault(request_id, []).append(row)

    engine.runner.on_logits = record


def _force_tokens(engine: LLMEngine, forced: dict[str, list[int]]) -> None:
    """Make the runner feed back `forced` tokens instead of the ones it samples (eager steps)."""
    runner = engine.runner
    original = runner.forward

    def forward(shape):
        logits, sampled = original(shape)
        n, inputs = shape.num_samples, runner.inputs
        request_of = {row: request_id for request_id, row in runner.batch.row_of.items()}
        rows, offsets = inputs.sample_rows[:n].tolist(), inputs.offsets[:n].tolist()
        values = [forced[request_of[row]][offset] for row, offset in zip(rows, offsets)]
        tokens = torch.tensor(values, dtype=sampled.dtype, device=sampled.device)
        runner.row_tokens[inputs.sample_rows[:n]] = tokens
        return logits, tokens

    runner.forward = forward


@torch.no_grad()
def _float32_copy(model: LlamaForCausalLM, device: torch.device, max_len: int) -> LlamaForCausalLM:
    with torch.device("meta"):
        copy = LlamaForCausalLM(model.config, select_ops(device, "reference"), max_len)
    copy.to_empty(device=device)
    source = dict(model.named_parameters())
    for name, param in copy.named_parameters():
        param.data = source[name].float()
        source[name].data = torch.empty(0, device=device)  # free the bf16 copy as we go
    copy.reset_rope()
    return copy.eval()


def _float32_adapter(host: HostAdapter) -> HostAdapter:
    return HostAdapter(host.digest, host.rank, {g: t.float() for g, t in host.a.items()},
                       {g: t.float() for g, t in host.b.items()}, host.ranks)

"""`loraplex bench accuracy`: the mixed-adapter engine in bf16 (Triton kernels, CUDA graphs)
against its float32 reference path (torch reference ops, no graphs) on the same model and
adapters: a random Llama-3-8B-shaped model with random adapters, or (`--model`, `--adapter`) a
real model with trained PEFT adapters, prompted with the quick start's task prompts in its chat
template.

The bf16 engine generates greedily; the float32 engine is then fed the same tokens (teacher
forcing), so every position is compared in the same context: the share of positions whose
float32 argmax is the token bf16 chose, the relative distance of the logits, and the error of
the chosen token's log-probability. transformers + PEFT in bf16 on the same weights, adapters
and tokens is the baseline for what bf16 alone costs."""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loraplex.benchmarks import synthetic
from loraplex.benchmarks.decode import _device_name, load_or_random_model
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.lora_weights import HostAdapter
from loraplex.engine_config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from loraplex.kernels import select_ops
from loraplex.model.llama import LlamaForCausalLM
from loraplex.types import SamplingParams


@dataclass(frozen=True)
class AccuracyConfig:
    num_requests: int = 64
    """Each with its own adapter (random model), or the adapters and none in turn (`model_path`)."""
    prompt_len: int = 256
    """Of the random model's prompts (a real model's are the task prompts as they are)."""
    new_tokens: int = 64
    rank: int = 16
    init: str = "scaled"
    """"normal": every weight N(0, 0.02); "scaled": o_proj and down_proj N(0, 0.02 / sqrt(2 *
    layers)) (GPT-2's residual scaling), a better-conditioned random model."""
    device: str = "cuda"
    model: dict[str, Any] = field(default_factory=dict)
    """config.json overrides of the Llama-3-8B shape."""
    model_path: str = ""
    """A real model's folder (as `loraplex model import` writes it) instead of a random model."""
    adapters: dict[str, str] = field(default_factory=dict)
    """With `model_path`: PEFT adapter folders by name. Request i uses none, then each adapter
    in turn; an adapter named after a quick-start task gets that task's prompts."""
    seed: int = 0


@dataclass
class _Case:
    """What both engines and transformers run: the bf16 model, the adapters by name (host
    tensors, or PEFT folders that each engine reads in its own dtype), each request's adapter
    (None: the base model) and prompt."""

    model: LlamaForCausalLM
    adapters: dict[str, HostAdapter | Path]
    assignment: list[str | None]
    prompts: list[list[int]]
    max_len: int
    max_rank: int


def run(config: AccuracyConfig) -> dict[str, Any]:
    device = torch.device(config.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference computes in float32
    started = time.perf_counter()
    case = _real_case(config, device) if config.model_path else _random_case(config, device)
    _progress("model and adapters built", started)
    tokens, bf16_logits = _generate(config, case, case.adapters, "bfloat16", forced=None)
    bf16_s = time.perf_counter() - started
    _progress("bf16 engine done", started)
    hf_logits = _hf_peft_logits(case.model, case, tokens)
    _progress("transformers + PEFT bf16 done", started)
    reference = _float32_copy(case.model, device, case.max_len)
    case.model = reference
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    fp32_adapters = {name: _float32_adapter(a) if isinstance(a, HostAdapter) else a
                     for name, a in case.adapters.items()}
    _, fp32_logits = _generate(config, case, fp32_adapters, "float32", forced=tokens)
    _progress("float32 reference done", started)
    result = {
        "check": "accuracy", "config": asdict(config), "device": _device_name(device),
        "torch": torch.__version__, "seconds": round(time.perf_counter() - started, 1),
        "bf16_run_seconds": round(bf16_s, 1), **compare(bf16_logits, fp32_logits),
        "transformers_peft_bf16": compare(hf_logits, fp32_logits),
    }
    if config.model_path:
        hf_fp32_logits = _hf_peft_logits(reference, case, tokens)
        _progress("transformers + PEFT float32 done", started)
        result["transformers_peft_float32"] = compare(hf_fp32_logits, fp32_logits)
        result["by_adapter"] = {
            name or "base": {
                "loraplex_bf16": compare(*_rows(case, name, bf16_logits, fp32_logits)),
                "transformers_peft_bf16": compare(*_rows(case, name, hf_logits, fp32_logits)),
            } for name in dict.fromkeys(case.assignment)}
        result["sample_replies"] = _sample_replies(config.model_path, case, tokens)
    return result


def _random_case(config: AccuracyConfig, device: torch.device) -> _Case:
    max_len = config.prompt_len + config.new_tokens + 16
    model_config, model = load_or_random_model("", config.model, select_ops(device), torch.bfloat16, device,
                                               max_len, config.seed, scaled_residual=config.init == "scaled")
    names = [f"adapter-{i}" for i in range(config.num_requests)]
    adapters: dict[str, HostAdapter | Path] = {
        name: synthetic.random_adapter(model_config, config.rank, torch.bfloat16, device, str(i),
                                       seed=1000 + i, pin=False) for i, name in enumerate(names)}
    generator = torch.Generator().manual_seed(config.seed)
    prompts = torch.randint(1000, model_config.vocab_size - 1000, (config.num_requests, config.prompt_len),
                            generator=generator).tolist()
    return _Case(model, adapters, list(names), prompts, max_len, config.rank)


def _real_case(config: AccuracyConfig, device: torch.device) -> _Case:
    from transformers import AutoTokenizer

    from loraplex.quickstart.tasks import make_tasks
    from loraplex.quickstart.train import chat_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(config.model_path)
    tasks = {task.name: task.test + task.train for task in make_tasks()}
    every_task = [ex for examples in zip(*tasks.values()) for ex in examples]
    turns: list[str | None] = [None, *config.adapters]
    assignment, prompts = [], []
    for i in range(config.num_requests):
        name = turns[i % len(turns)]
        examples = tasks.get(name or "", every_task)
        assignment.append(name)
        prompts.append(chat_prompt_ids(tokenizer, examples[(i // len(turns)) % len(examples)].prompt))
    max_len = max(map(len, prompts)) + config.new_tokens + 16
    _, model = load_or_random_model(config.model_path, {}, select_ops(device), torch.bfloat16, device,
                                    max_len, config.seed)
    adapters: dict[str, HostAdapter | Path] = {name: Path(folder) for name, folder in config.adapters.items()}
    ranks = [json.loads((folder / "adapter_config.json").read_text())["r"] for folder in adapters.values()]
    return _Case(model, adapters, assignment, prompts, max_len, max(ranks, default=config.rank))


def _rows(case: _Case, name: str | None, ours: list[torch.Tensor], reference: list[torch.Tensor]
          ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    picked = [i for i, a in enumerate(case.assignment) if a == name]
    return [ours[i] for i in picked], [reference[i] for i in picked]


def _sample_replies(model_path: str, case: _Case, tokens: list[list[int]], count: int = 8) -> list[dict]:
    """The first requests' prompts and bf16 replies, as text (to see that they are answers)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return [{"adapter": case.assignment[i], "prompt": tokenizer.decode(case.prompts[i]),
             "reply": tokenizer.decode(tokens[i])} for i in range(min(count, len(tokens)))]


def _progress(what: str, started: float) -> None:
    print(f"[{time.perf_counter() - started:7.1f} s] {what}", flush=True)


def compare(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> dict[str, Any]:
    """Greedy agreement (the two argmaxes agree) and relative logit error over every (request,
    position), logits [positions, vocab] per request."""
    agree, errors, logprob_errors = [], [], []
    for a, b in zip(ours, reference):
        chosen = a.argmax(dim=-1, keepdim=True)
        agree.extend((chosen[:, 0] == b.argmax(dim=-1)).tolist())
        errors.extend(((a - b).norm(dim=-1) / b.norm(dim=-1)).tolist())
        logprob_a = torch.log_softmax(a.float(), dim=-1).gather(-1, chosen)
        logprob_b = torch.log_softmax(b.float(), dim=-1).gather(-1, chosen)
        logprob_errors.extend((logprob_a - logprob_b).abs()[:, 0].tolist())
    errors_np, logprob_np = np.asarray(errors), np.asarray(logprob_errors)
    return {
        "positions": len(agree), "identical_greedy_fraction": round(float(np.mean(agree)), 5),
        "logits_rel_error_max": float(errors_np.max()),
        "logits_rel_error_median": float(np.median(errors_np)),
        "logits_rel_error_p99": float(np.quantile(errors_np, 0.99)),
        "chosen_logprob_abs_error_median": float(np.median(logprob_np)),
        "chosen_logprob_abs_error_p99": float(np.quantile(logprob_np, 0.99)),
        "chosen_logprob_abs_error_max": float(logprob_np.max()),
    }


def _generate(config: AccuracyConfig, case: _Case, adapters: dict[str, HostAdapter | Path], dtype: str,
              forced: list[list[int]] | None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy generation of every prompt with its adapter; with `forced`, the tokens fed back
    are those instead of the sampled ones. Returns (tokens, logits [new_tokens, vocab] float32
    on the CPU) per request."""
    max_len = case.model.max_positions
    engine = LLMEngine(EngineConfig(
        model=config.model_path or "synthetic-llama-3-8b", device=config.device, dtype=dtype,
        max_model_len=max_len,
        kernels="auto" if dtype == "bfloat16" else "reference", enforce_eager=forced is not None,
        cache=CacheConfig(num_kv_blocks=len(case.prompts) * -(-max_len // 16) + 1),
        scheduler=SchedulerConfig(max_num_seqs=len(case.prompts), max_num_batched_tokens=4096),
        lora=LoRAConfig(max_lora_rank=case.max_rank, max_loras=max(1, len(adapters))),
    ), model=case.model)
    for name, source in adapters.items():
        engine.add_adapter(name, source)
    logits: dict[str, list[torch.Tensor]] = {}
    _record_logits(engine, logits)
    if forced is not None:
        _force_tokens(engine, {f"r{i}": t for i, t in enumerate(forced)})
    params = SamplingParams(max_tokens=config.new_tokens, temperature=0.0, ignore_eos=True)
    for i, (prompt, adapter) in enumerate(zip(case.prompts, case.assignment)):
        engine.add_request(f"r{i}", prompt_token_ids=prompt, params=params, adapter=adapter)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output.token_ids
    engine.close()
    ids = [f"r{i}" for i in range(len(case.prompts))]
    return [outputs[r] for r in ids], [torch.stack(logits[r]) for r in ids]


@torch.no_grad()
def _hf_peft_logits(model: LlamaForCausalLM, case: _Case, tokens: list[list[int]], chunk: int = 8
                    ) -> list[torch.Tensor]:
    """transformers + PEFT on `model`'s weights (shared, in its dtype), the same adapters and
    tokens: the logits of every generated position. Requests with prompts of one length run
    together, `chunk` at a time, each with its own adapter."""
    peft = _peft_model(synthetic.hf_model_sharing_weights(model), case, model)
    device = model.embed_tokens.device
    new = len(tokens[0])
    logits: list[torch.Tensor | None] = [None] * len(case.prompts)
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(case.prompts):
        by_length.setdefault(len(prompt), []).append(i)
    for rows in by_length.values():
        for start in range(0, len(rows), chunk):
            part = rows[start:start + chunk]
            ids = torch.tensor([case.prompts[i] + tokens[i][:-1] for i in part], device=device)
            names = [case.assignment[i] or "__base__" for i in part]
            kwargs = {"adapter_names": names} if case.adapters else {}
            out = peft(input_ids=ids, logits_to_keep=new, **kwargs)
            for i, row in zip(part, out.logits.float().cpu()):
                logits[i] = row
    del peft
    return logits  # type: ignore[return-value]


def _peft_model(hf_model: Any, case: _Case, model: LlamaForCausalLM) -> Any:
    """PEFT around `hf_model` with the case's adapters: the host tensors copied in, or the PEFT
    folders read (cast to the model's dtype)."""
    from loraplex.peft_reference import peft_with_adapters

    hosts = {n: a for n, a in case.adapters.items() if isinstance(a, HostAdapter)}
    if hosts:
        return synthetic.add_peft_adapters(hf_model, hosts, model.config)
    return peft_with_adapters(hf_model, case.adapters).to(dtype=model.embed_tokens.dtype).eval()


def _record_logits(engine: LLMEngine, into: dict[str, list[torch.Tensor]]) -> None:
    def record(sampled_ids: list[str], logits: torch.Tensor) -> None:
        for request_id, row in zip(sampled_ids, logits.float().cpu()):
            into.setdefault(request_id, []).append(row)

    engine.runner.on_logits = record


def _force_tokens(engine: LLMEngine, forced: dict[str, list[int]]) -> None:
    """Make the runner feed back `forced` tokens instead of the ones it samples (eager steps)."""
    runner = engine.runner
    original = runner.forward

    def forward(shape, prompt=None):
        logits, sampled, scored = original(shape, prompt)
        n, inputs = shape.num_samples, runner.inputs
        request_of = {row: request_id for request_id, row in runner.batch.row_of.items()}
        rows, offsets = inputs.sample_rows[:n].tolist(), inputs.offsets[:n].tolist()
        values = [forced[request_of[row]][offset] for row, offset in zip(rows, offsets)]
        tokens = torch.tensor(values, dtype=sampled.dtype, device=sampled.device)
        runner.row_tokens[inputs.sample_rows[:n]] = tokens
        return logits, tokens, scored

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

"""`loraplex bench decode`: multi-adapter decode throughput on a Llama-3-8B-shaped model with
random weights (or a real model's folder, `--model`), against transformers + PEFT on the same
weights and adapters, each figure next to its floor: the bytes a step must read (weights, KV,
adapters) at the device's measured copy bandwidth, or its FLOPs at the device's measured matrix
throughput, whichever binds (loraplex.benchmarks.device_floors). The adapters are random, one
per request: a step costs the same whatever their values."""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from loraplex.benchmarks import synthetic
from loraplex.benchmarks.device_floors import DeviceFloors, measure
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine_config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from loraplex.kernels import engine_ops
from loraplex.model.llama import LlamaForCausalLM
from loraplex.model.loader import load_model
from loraplex.model.model_config import ModelConfig
from loraplex.types import SamplingParams

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections every benchmark adapter targets."""


@dataclass(frozen=True)
class DecodeBenchConfig:
    batch_sizes: tuple[int, ...] = (1, 8, 32, 64, 128)
    prompt_len: int = 512
    new_tokens: int = 128
    rank: int = 16
    """Rank of every adapter (all seven projections)."""
    hf_batch_sizes: tuple[int, ...] = (1, 8, 32)
    """Batches run through transformers (+ PEFT); larger ones take minutes."""
    hf_new_tokens: int = 16
    hf_adapters: int = 0
    """Distinct PEFT adapters, the batch's requests taking them in turn (0: one per request, as
    ours take). PEFT adds adapters one by one, each walking the whole model (256 took minutes on
    the H100 host); fewer distinct adapters also make its mixed-batch step cheaper, so a bound in
    its favour."""
    startup_batch: int = 64
    """Requests of the first batches after start-up (first against again, cold adapters
    against resident ones)."""
    bandwidth: float = 0.0
    """Memory bandwidth the floor is computed with (bytes/s); 0: the device's, measured."""
    device: str = "cuda"
    dtype: str = "bfloat16"
    model: dict[str, Any] = field(default_factory=dict)
    """config.json overrides of the Llama-3-8B shape (a tiny model for a CPU smoke run)."""
    model_path: str = ""
    """A model folder (config.json and safetensors, as `loraplex model import` writes them):
    its shape and weights instead of the random Llama-3-8B."""
    seed: int = 0


def run(config: DecodeBenchConfig) -> dict[str, Any]:
    device, dtype = torch.device(config.device), getattr(torch, config.dtype)
    max_len = config.prompt_len + config.new_tokens + 16
    ops = engine_ops(device)
    floors = device_floors(config)  # before the model and KV cache take the memory
    started = time.perf_counter()
    model_config, model = load_or_random_model(config.model_path, config.model, ops, dtype, device, max_len,
                                               config.seed)
    num_adapters = max(config.batch_sizes)
    adapters = {f"adapter-{i}": synthetic.random_adapter(
        model_config, config.rank, dtype, device, str(i), seed=1000 + i, pin=device.type == "cuda")
        for i in range(num_adapters)}
    setup_s = time.perf_counter() - started
    print(f"model and {num_adapters} adapters (in host memory) built in {setup_s:.1f} s", flush=True)
    started = time.perf_counter()
    engine = _engine(config, model, max_len)
    build_s = time.perf_counter() - started
    for name, host in adapters.items():
        engine.add_adapter(name, host)
    startup = _startup_report(engine, build_s)
    print(json.dumps(startup), flush=True)
    compiles = _count_compiles()
    warm_up = _warm_up_rows(engine, config, model_config, list(adapters))
    warm_up["kernel_compiles"] = list(compiles)  # during the first batches: none expected
    rows = []
    for batch in config.batch_sizes:
        for with_adapters in (False, True):
            rows.append(_run_ours(engine, config, model_config, batch, with_adapters, list(adapters)))
            _print_row(rows[-1])
    if config.hf_batch_sizes:
        rows += _run_hf_baselines(config, model, model_config, adapters)
    return {
        "benchmark": "decode", "config": asdict(config), "device": _device_name(device),
        "torch": torch.__version__, "device_floors": floors.as_dict(), "setup_s": round(setup_s, 1),
        "startup": startup,
        "first_batches": warm_up, "weight_bytes": _weight_bytes(model), "rows": rows,
    }


def load_or_random_model(path: str, overrides: dict[str, Any], ops, dtype: torch.dtype, device: torch.device,
                         max_len: int, seed: int, scaled_residual: bool = False,
                         ) -> tuple[ModelConfig, LlamaForCausalLM]:
    """The model in folder `path`, or (no path) a random one of the Llama-3-8B shape with
    `overrides`."""
    if path:
        model_config = ModelConfig.load(path)
        return model_config, load_model(path, model_config, ops, dtype, device, max_len)
    model_config = synthetic.model_config(overrides)
    return model_config, synthetic.random_model(model_config, ops, dtype, device, max_len, seed=seed,
                                                scaled_residual=scaled_residual)


def _count_compiles() -> list[str]:
    """A list that Triton's JIT appends the name of every kernel variant it compiles from now
    on (left empty where this Triton has no such hook)."""
    compiled: list[str] = []
    try:
        import triton

        def hook(*args: Any, **kwargs: Any) -> bool:
            compiled.append(getattr(kwargs.get("fn"), "name", "") or str(kwargs.get("repr"))[:200])
            return False  # compile as usual

        triton.knobs.runtime.jit_cache_hook = hook
    except (ImportError, AttributeError):
        pass
    return compiled


def _startup_report(engine: LLMEngine, build_s: float) -> dict[str, Any]:
    """What building the engine did: its time, the memory plan, the graphs it captured."""
    graphs = engine.graphs
    return {
        "engine_build_s": round(build_s, 1), "memory": asdict(engine.memory),
        "graphs": None if graphs is None else {
            "num_graphs": graphs.num_graphs, "capture_s": round(graphs.seconds, 1),
            "pool_mib": round(graphs.pool_bytes / 2**20, 1),
            "static_outputs_mib": round(graphs.output_bytes / 2**20, 1)},
    }


def _warm_up_rows(engine: LLMEngine, config: DecodeBenchConfig, model_config: ModelConfig,
                  names: list[str]) -> dict[str, Any]:
    """The first batches after start-up against the same batches run again: without adapters
    (does the first pay for anything, such as a graph capture?), then with one adapter per
    request, cold (read into their slots during the run) and then resident."""
    batch = min(config.startup_batch, max(config.batch_sizes))
    runs = {}
    for label, with_adapters in (("first", False), ("again", False), ("cold_adapters", True),
                                 ("resident_adapters", True)):
        runs[label] = _run_ours(engine, config, model_config, batch, with_adapters, names, tag=label)
        print(label, json.dumps(runs[label]), flush=True)
    runs["first_over_again_decode"] = round(runs["first"]["tok_s"] / runs["again"]["tok_s"], 3)
    runs["cold_over_resident_end_to_end"] = round(
        runs["cold_adapters"]["e2e_tok_s"] / runs["resident_adapters"]["e2e_tok_s"], 3)
    runs["num_lora_slots"] = engine.memory.num_lora_slots
    return runs


def profile(config: DecodeBenchConfig, steps: int = 8) -> str:
    """Where a decode step's time goes: the kernels of `steps` steps at each batch size, with
    and without adapters, as torch.profiler tables, and each step's wall time against the
    GPU time of its kernels (the difference is host time the GPU waits for)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    device, dtype = torch.device(config.device), getattr(torch, config.dtype)
    max_len = config.prompt_len + steps + 32
    model_config, model = load_or_random_model(config.model_path, config.model, engine_ops(device), dtype,
                                               device, max_len, config.seed)
    num_adapters = max(config.batch_sizes)
    engine = _engine(config, model, max_len)
    for i in range(num_adapters):
        engine.add_adapter(f"adapter-{i}", synthetic.random_adapter(
            model_config, config.rank, dtype, device, str(i), seed=1000 + i, pin=device.type == "cuda"))
    report = []
    for batch in config.batch_sizes:
        for with_adapters in (False, True):
            prompts = _prompts(config, model_config, batch).tolist()
            params = SamplingParams(max_tokens=steps + 3, temperature=0.0, ignore_eos=True)
            for i, prompt in enumerate(prompts):
                engine.add_request(f"p{batch}-{with_adapters}-{i}", prompt_token_ids=prompt, params=params,
                                   adapter=f"adapter-{i}" if with_adapters else None)
            for _ in range(3):  # prefill, then two warm decode steps
                engine.step()
            _sync(device)
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                started = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                _sync(device)
                wall = (time.perf_counter() - started) / steps
            while engine.has_unfinished_requests():
                engine.step()
            events = prof.key_averages()
            gpu_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
                         for e in events) / steps
            sort_key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") \
                else "self_cuda_time_total"
            report.append(f"\n=== batch {batch}, adapters {batch if with_adapters else 0}: "
                          f"step wall {wall * 1e3:.3f} ms, kernels {gpu_us / 1e3:.3f} ms per step ===\n")
            report.append(events.table(sort_by=sort_key, row_limit=22, max_name_column_width=60))
            print(report[-2], report[-1], flush=True)
    return "".join(report)


def _engine(config: DecodeBenchConfig, model, max_len: int, flora_graphs: bool = False) -> LLMEngine:
    """Slots and KV blocks sized from memory, as `loraplex serve` sizes them (`flora_graphs`:
    decode graphs for FLoRA steps too)."""
    return LLMEngine(EngineConfig(
        model=config.model_path or "synthetic-llama-3-8b", device=config.device, dtype=config.dtype,
        max_model_len=max_len, seed=config.seed, cache=CacheConfig(block_size=16),
        scheduler=SchedulerConfig(max_num_seqs=max(config.batch_sizes), max_num_batched_tokens=16384),
        lora=LoRAConfig(max_lora_rank=config.rank, flora_graphs=flora_graphs),
    ), model=model)


def _prompts(config: DecodeBenchConfig, model_config: ModelConfig, batch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(config.seed + batch)
    shape = (batch, config.prompt_len)
    return torch.randint(1000, model_config.vocab_size - 1000, shape, generator=generator)


def _run_ours(engine: LLMEngine, config: DecodeBenchConfig, model_config: ModelConfig, batch: int,
              with_adapters: bool, names: list[str], tag: str = "") -> dict[str, Any]:
    # Every run computes its prompts (the same prompts come back: from the prefix cache, the
    # "again" and "resident" runs skipped their prefill and cold/resident read 0.58, not 0.96).
    engine.blocks.reset_prefix_cache()
    prompts = _prompts(config, model_config, batch).tolist()
    params = SamplingParams(max_tokens=config.new_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{batch}-{with_adapters}-{tag}-{i}", prompt_token_ids=prompt, params=params,
                           adapter=names[i] if with_adapters else None)
    started = time.perf_counter()
    first_token: set[str] = set()
    decode_start = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        first_token.update(o.request_id for o in outputs)
        if decode_start is None and len(first_token) == batch:
            decode_start = time.perf_counter()  # every prompt is done; the next step runs
    _sync(engine.device)
    ended = time.perf_counter()
    steps = config.new_tokens - 1
    row = _row("loraplex", batch, with_adapters, (ended - decode_start) / steps, decode_start - started,
               config, model_config, engine.model)
    row["e2e_tok_s"] = round(batch * config.new_tokens / (ended - started), 1)
    return row


def _run_hf_baselines(config: DecodeBenchConfig, model, model_config: ModelConfig, adapters: dict
                      ) -> list[dict[str, Any]]:
    """transformers, then transformers + PEFT with one adapter per request, on the same weights."""
    rows = []
    hf = synthetic.hf_model_sharing_weights(model)
    for batch in config.hf_batch_sizes:
        rows.append(_run_hf(hf, config, model_config, batch, None))
        _print_row(rows[-1])
    distinct = config.hf_adapters or max(config.hf_batch_sizes)
    peft_adapters = dict(list(adapters.items())[:distinct])
    peft = synthetic.add_peft_adapters(hf, peft_adapters, model_config)
    names = list(peft_adapters)
    for batch in config.hf_batch_sizes:
        rows.append(_run_hf(peft, config, model_config, batch, [names[i % len(names)] for i in range(batch)]))
        rows[-1]["distinct_adapters"] = min(batch, len(names))
        _print_row(rows[-1])
    return rows


def _run_hf(model, config: DecodeBenchConfig, model_config: ModelConfig, batch: int,
            adapter_names: list[str] | None) -> dict[str, Any]:
    device = next(model.parameters()).device
    input_ids = _prompts(config, model_config, batch).to(device)
    kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(input_ids))
    if adapter_names is not None:
        kwargs["adapter_names"] = adapter_names
    with torch.no_grad():
        model.generate(input_ids, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
        _sync(device)
        started = time.perf_counter()
        model.generate(input_ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        _sync(device)
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        n = config.hf_new_tokens
        model.generate(input_ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        _sync(device)
        total_s = time.perf_counter() - started
    engine_name = "transformers+peft" if adapter_names is not None else "transformers"
    step_s = (total_s - prefill_s) / (config.hf_new_tokens - 1)
    if step_s <= 0:  # a busy host made the prefill alone take longer than it did with the steps
        step_s = total_s / config.hf_new_tokens
    return _row(engine_name, batch, adapter_names is not None, step_s, prefill_s, config, model_config, None)


def device_floors(config: DecodeBenchConfig) -> DeviceFloors:
    """The device's measured figures (`config.bandwidth`, when set, in place of the copy's)."""
    floors = measure(config.device, config.dtype)
    return replace(floors, copy_bytes_per_s=config.bandwidth) if config.bandwidth else floors


def _row(engine: str, batch: int, with_adapters: bool, step_s: float, prefill_s: float,
         config: DecodeBenchConfig, model_config: ModelConfig, model) -> dict[str, Any]:
    floor = device_floors(config).floor(_floor_bytes(config, model_config, batch, with_adapters),
                                        _step_flops(config, model_config, batch, with_adapters))
    floor_s = floor["floor_s"]
    return {
        "engine": engine, "batch": batch, "adapters": batch if with_adapters else 0,
        "rank": config.rank if with_adapters else 0,
        "step_ms": round(step_s * 1e3, 3), "tok_s": round(batch / step_s, 1),
        "floor_step_ms": round(floor_s * 1e3, 3), "floor_tok_s": round(batch / floor_s, 1),
        "fraction_of_floor": round(floor_s / step_s, 3), "floor_binding": floor["binding"],
        "bytes_floor_ms": round(floor["bytes_floor_s"] * 1e3, 3),
        "flops_floor_ms": round(floor["flops_floor_s"] * 1e3, 3), "prefill_s": round(prefill_s, 3),
    }


def _step_flops(config: DecodeBenchConfig, c: ModelConfig, batch: int, with_adapters: bool) -> float:
    """FLOPs of a decode step: every row through the weights (the lm_head included), its
    attention over its mean context (scores and values), and its adapter's shrink and expand."""
    layer = (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
             + 3 * c.hidden_size * c.intermediate_size)
    weights = 2 * batch * (c.num_layers * layer + c.vocab_size * c.hidden_size)
    mean_context = config.prompt_len + config.new_tokens / 2
    attention = 4 * batch * mean_context * c.num_layers * c.q_size
    per_rank = c.num_layers * sum(sum(c.shape.features(m)) for m in LORA_MODULES)
    adapters = 2 * batch * config.rank * per_rank if with_adapters else 0
    return weights + attention + adapters


def _floor_bytes(config: DecodeBenchConfig, c: ModelConfig, batch: int, with_adapters: bool) -> float:
    element = torch.empty((), dtype=getattr(torch, config.dtype)).element_size()
    layer = (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
             + 3 * c.hidden_size * c.intermediate_size)
    weights = (c.num_layers * layer + c.vocab_size * c.hidden_size) * element
    mean_context = config.prompt_len + config.new_tokens / 2
    kv = batch * mean_context * c.num_layers * 2 * c.kv_size * element
    per_rank = c.num_layers * sum(sum(c.shape.features(m)) for m in LORA_MODULES) * element
    adapters = batch * config.rank * per_rank if with_adapters else 0
    return weights + kv + adapters


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "embed_tokens")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def _print_row(row: dict[str, Any]) -> None:
    print(f"{row['engine']:18s} batch {row['batch']:4d}  adapters {row['adapters']:4d}  "
          f"{row['tok_s']:9.1f} tok/s  step {row['step_ms']:8.2f} ms  "
          f"floor {row['floor_step_ms']:7.2f} ms ({row['floor_tok_s']:9.1f} tok/s)  "
          f"{100 * row['fraction_of_floor']:5.1f}% of floor ({row['floor_binding']})"
          + (f"  {row['distinct_adapters']} distinct adapters" if "distinct_adapters" in row else ""),
          flush=True)


def plot(json_path: Path, png_path: Path) -> None:
    """Throughput against batch size for each engine, with the floor (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(json_path.read_text())
    fig, ax = plt.subplots(figsize=(8, 5))
    series: dict[str, list[dict]] = {}
    for row in result["rows"]:
        label = f"{row['engine']} ({'distinct adapters' if row['adapters'] else 'no adapter'})"
        series.setdefault(label, []).append(row)
    for label, rows in series.items():
        ax.plot([r["batch"] for r in rows], [r["tok_s"] for r in rows], marker="o", label=label)
    floors = {r["batch"]: r["floor_tok_s"] for r in result["rows"]
              if r["engine"] == "loraplex" and not r["adapters"]}
    ax.plot(list(floors), list(floors.values()), "k--", label="floor, no adapter")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (requests decoding together)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Decode, Llama-3-8B shape, bf16, {result['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)

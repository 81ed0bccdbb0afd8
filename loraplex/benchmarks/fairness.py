"""`loraplex bench fairness`: one tenant floods, three send their share; light tenants' latency
under VTC with KV swapping against running alone and against FCFS, throughput against FCFS,
swap bandwidth both ways, the device idle time that swaps cause (steps waiting for copies),
and the cost of resuming a long swapped request against recomputing it.

Llama-3-8B shape with random weights (bf16 on CUDA), 4 tenants each with its own rank-16 adapter
on all seven projections, Poisson arrivals; the heavy tenant sends `heavy_factor` times what each
light one sends, enough together to overload the engine and make it preempt. Each policy sees
the same arrivals (same seed) on the same engine (the policy is swapped between runs); a run
stops taking arrivals after `duration_s` and ends `drain_s` later (requests still waiting then
count with the time they had waited). Run from the repository root; JSON under bench/results/."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from loraplex.benchmarks import synthetic
from loraplex.benchmarks.fairness_workload import (
    RUNS,
    TENANTS,
    FairnessWorkload,
    group_figures,
    make_arrivals,
    summarize,
    system_prompts,
)
from loraplex.benchmarks.results import RESULTS, write
from loraplex.benchmarks.serve_workload import FIRST_TOKEN, BenchRequest
from loraplex.benchmarks.step_timing import TimedStep
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.policy import FcfsPolicy, VtcPolicy
from loraplex.engine_config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from loraplex.kernels import engine_ops
from loraplex.types import SamplingParams


@dataclass(frozen=True)
class FairnessBenchConfig:
    light_rate: float = 3.0
    """Requests a second from each light tenant."""
    heavy_factor: float = 4.0
    prompt_len: tuple[int, int] = (512, 2048)
    """Prompt lengths, uniform in [low, high]."""
    output_len: tuple[int, int] = (64, 256)
    duration_s: float = 30.0
    drain_s: float = 15.0
    max_num_seqs: int = 256
    num_kv_blocks: int = 4096
    """KV blocks (16 tokens each): fewer than the running requests need, so that it preempts."""
    rank: int = 16
    resume_tokens: int = 2000
    system_prompt_len: int = 0
    """Tokens of each tenant's registered system prompt, pinned before the runs (0: none)."""
    runs: tuple[str, ...] = ("alone", "fcfs", "vtc")
    """Which runs: light tenants alone (VTC), everyone under FCFS, everyone under VTC."""
    device: str = "cuda"
    model: dict[str, Any] | None = None
    seed: int = 0
    max_capped_prefill_tokens: int | None = None
    """VTC's prompt-chunk cap (None: the engine's default)."""
    max_num_batched_tokens: int = 8192
    """Token budget of a step."""
    fairness_kv_headroom: float | None = None
    """SchedulerConfig.fairness_kv_headroom (None: the engine's default)."""

    def workload(self, vocab_size: int) -> FairnessWorkload:
        return FairnessWorkload(light_rate=self.light_rate, heavy_factor=self.heavy_factor,
                                prompt_len=self.prompt_len, output_len=self.output_len,
                                duration_s=self.duration_s, system_prompt_len=self.system_prompt_len,
                                vocab_size=vocab_size, seed=self.seed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="loraplex bench fairness", description=__doc__)
    parser.add_argument("--light-rate", type=float, default=3.0)
    parser.add_argument("--num-kv-blocks", type=int, default=4096)
    parser.add_argument("--heavy-factor", type=float, default=4.0)
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--drain-s", type=float, default=15.0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model-overrides", type=json.loads, default=None)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(512, 2048))
    parser.add_argument("--output-len", type=int, nargs=2, default=(64, 256))
    parser.add_argument("--resume-tokens", type=int, default=2000)
    parser.add_argument("--system-prompt-len", type=int, default=0,
                        help="tokens of each tenant's registered system prompt (0: none)")
    parser.add_argument("--runs", type=lambda text: tuple(text.split(",")), default=("alone", "fcfs", "vtc"),
                        help="comma-separated subset of alone,fcfs,vtc (default: all three)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-capped-prefill-tokens", type=int, default=None,
                        help="VTC's prompt-chunk cap (default: the engine's)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="token budget of a step (default 8192)")
    parser.add_argument("--fairness-kv-headroom", type=float, default=None,
                        help="share of the KV cache that the most-served tenant leaves free "
                             "(default: the engine's)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"results folder (default {RESULTS})")
    args = parser.parse_args(argv)
    config = FairnessBenchConfig(
        light_rate=args.light_rate, heavy_factor=args.heavy_factor, duration_s=args.duration_s,
        drain_s=args.drain_s, max_num_seqs=args.max_num_seqs, device=args.device,
        model=args.model_overrides, prompt_len=tuple(args.prompt_len), output_len=tuple(args.output_len),
        resume_tokens=args.resume_tokens, num_kv_blocks=args.num_kv_blocks,
        system_prompt_len=args.system_prompt_len, runs=args.runs, seed=args.seed,
        max_capped_prefill_tokens=args.max_capped_prefill_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens, fairness_kv_headroom=args.fairness_kv_headroom)
    name = "fairness" + (f"-system-prompts-{config.system_prompt_len}" if config.system_prompt_len else "")
    path = write(run(config), args.out, name)
    print(f"wrote {path}")
    if set(config.runs) != {"alone", "fcfs", "vtc"}:
        return
    try:
        plot(path, path.with_suffix(".png"))
        print(f"wrote {path.with_suffix('.png')}")
    except ImportError:
        print("matplotlib is not installed: no plot (run `python -m loraplex.benchmarks.plot` later)")


def run(config: FairnessBenchConfig) -> dict[str, Any]:
    device = torch.device(config.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_config = synthetic.model_config(config.model)
    max_len = max(config.prompt_len[1] + config.output_len[1], config.resume_tokens + 1) + 16
    model = synthetic.random_model(model_config, engine_ops(device), dtype, device, max_len, seed=config.seed)
    engine = LLMEngine(EngineConfig(
        model="synthetic-llama-3-8b", device=config.device, dtype=str(dtype).removeprefix("torch."),
        max_model_len=max_len,
        cache=CacheConfig(block_size=16, swap_space=16, num_kv_blocks=config.num_kv_blocks),
        scheduler=SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  **({"max_capped_prefill_tokens": config.max_capped_prefill_tokens}
                                     if config.max_capped_prefill_tokens else {}),
                                  **({"fairness_kv_headroom": config.fairness_kv_headroom}
                                     if config.fairness_kv_headroom is not None else {})),
        lora=LoRAConfig(max_lora_rank=config.rank, max_loras=len(TENANTS))), model=model)
    for i, tenant in enumerate(TENANTS):
        engine.add_adapter(tenant, synthetic.random_adapter(model_config, config.rank, dtype, device, tenant,
                                                            seed=100 + i, pin=device.type == "cuda"))
    host_blocks = engine.scheduler.host_blocks.num_blocks
    print(f"{engine.memory.num_kv_blocks} KV blocks, host pool {host_blocks} blocks", flush=True)
    workload = config.workload(model_config.vocab_size)
    if config.system_prompt_len:
        _pin_system_prompts(engine, workload)
    runs = {RUNS[name]: _run(engine, config, make_arrivals(workload, heavy=name != "alone"),
                             "fcfs" if name == "fcfs" else "vtc", name)
            for name in RUNS if name in config.runs}
    summary = summarize(runs)
    result = {
        "benchmark": "fairness", "config": asdict(config), "device": _device_name(device),
        "torch": torch.__version__, "kv_blocks": engine.memory.num_kv_blocks, "runs": runs,
        "summary": summary, "swap": _swap_costs(engine, config, model_config.vocab_size),
    }
    print(json.dumps(summary, indent=2), flush=True)
    return result


def _pin_system_prompts(engine: LLMEngine, workload: FairnessWorkload) -> None:
    """Each tenant's system prompt registered as the server registers one: prefilled under the
    tenant's adapter and pinned."""
    for tenant, tokens in system_prompts(workload).items():
        engine.pin_prompt(f"system-{tenant}", tokens, tenant=tenant, adapter=tenant)
    while engine.has_unfinished_requests():
        engine.step()
    engine.drain()
    print(f"pinned system prompts: {engine.pinned_prompts()}", flush=True)


def _run(engine: LLMEngine, config: FairnessBenchConfig, arrivals: list[BenchRequest], policy: str,
         name: str) -> dict[str, Any]:
    engine.scheduler.policy = (VtcPolicy(engine.tenants, engine.config.scheduler.fairness_bound)
                               if policy == "vtc" else FcfsPolicy(engine.tenants))
    before = engine.stats()
    times: dict[str, list[float]] = {}
    arrived: dict[str, tuple[float, str]] = {}  # request id -> (arrival, tenant)
    pending = list(arrivals)
    started = time.perf_counter()
    end = config.duration_s + config.drain_s
    tokens = steps = 0
    step_log: list[tuple[int, int, float]] = []  # per busy step: prompt tokens planned, running, wall s
    timed: list[TimedStep] = []
    engine.time_steps(lambda plan, device_s: timed.append(TimedStep.of(plan, device_s)))
    while (now := time.perf_counter() - started) < end and (pending or engine.has_unfinished_requests()):
        while pending and pending[0].arrival_s <= now:
            request = pending.pop(0)
            request_id = f"{name}-{request.index}"
            engine.add_request(request_id, prompt_token_ids=request.prompt_token_ids,
                               params=SamplingParams(max_tokens=request.max_tokens, ignore_eos=True,
                                                     temperature=0.0),
                               adapter=request.adapter, tenant=request.tenant)
            arrived[request_id], times[request_id] = (request.arrival_s, request.tenant), []
        busy = engine.has_unfinished_requests()
        steps += busy
        prompt_before, step_start = engine.num_prompt_tokens, time.perf_counter()
        for output in engine.step():
            times[output.request_id].append(time.perf_counter() - started)
            tokens += 1
        if busy:
            step_log.append((engine.num_prompt_tokens - prompt_before, len(engine.scheduler.running),
                             time.perf_counter() - step_start))
    elapsed = time.perf_counter() - started
    engine.time_steps(None)
    for request_id in arrived:  # those still unfinished at the end (abort ignores the others)
        engine.abort(request_id)
    engine.drain()
    while engine.has_unfinished_requests():
        engine.step()
    after = engine.stats()
    per_tenant = group_figures(arrived, times, elapsed)
    minutes = elapsed / 60
    swapped_out = after.swap_bytes_out - before.swap_bytes_out
    swapped_in = after.swap_bytes_in - before.swap_bytes_in
    seconds_out = after.swap_seconds_out - before.swap_seconds_out
    seconds_in = after.swap_seconds_in - before.swap_seconds_in
    stalled = after.swap_seconds_stalled - before.swap_seconds_stalled
    row = {
        "policy": policy, "elapsed_s": round(elapsed, 1), "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / elapsed, 1), **per_tenant,
        "steps": steps, "prompt_tokens": after.num_prompt_tokens - before.num_prompt_tokens,
        "steps_by_prompt_tokens": _steps_by_prompt_tokens(step_log),
        "device_s": round(sum(t.device_s for t in timed), 2),
        "device_by_prompt_tokens": device_by_prompt_tokens(timed),
        "preemptions_per_minute": {k: round((n - before.preemptions.get(k, 0)) / minutes, 1)
                                   for k, n in after.preemptions.items() if n - before.preemptions.get(k, 0)},
        "swap_out_gb": round(swapped_out / 1e9, 2), "swap_in_gb": round(swapped_in / 1e9, 2),
        "swap_out_gb_per_s": round(swapped_out / seconds_out / 1e9, 1) if seconds_out else None,
        "swap_in_gb_per_s": round(swapped_in / seconds_in / 1e9, 1) if seconds_in else None,
        "swap_out_s_share_of_run": round(seconds_out / elapsed, 4),
        "swap_stall_s": round(stalled, 4), "swap_stall_share_of_run": round(stalled / elapsed, 5),
        "tenant_service": after.tenant_service,
    }
    print(json.dumps(row), flush=True)
    return row


T = TypeVar("T")
STEP_BUCKETS = ((0, 0), (1, 1024), (1025, 2048), (2049, 4096), (4097, 1 << 30))


def device_by_prompt_tokens(timed: list[TimedStep]) -> dict[str, dict[str, float]]:
    """The steps by the prompt tokens each planned, with each step's own device time (not its
    wall time, which with async scheduling is the step before it's): how many, mean and p99
    device ms, their total, the mean requests a step, and the same mean for the steps that
    moved KV to or from the host pool against those that did not (a swap-out makes the step
    wait for its copy; swap-ins run beside it)."""
    buckets = {}
    for label, rows in _by_prompt_tokens(timed, lambda step: step.prompt_tokens):
        swapping = [t.device_s for t in rows if t.swap_in_blocks or t.swap_out_blocks]
        quiet = [t.device_s for t in rows if not (t.swap_in_blocks or t.swap_out_blocks)]
        times = [t.device_s for t in rows]
        buckets[label] = {
            "steps": len(rows), "device_s": round(sum(times), 3),
            "mean_device_ms": round(float(np.mean(times)) * 1e3, 2),
            "p99_device_ms": round(float(np.percentile(times, 99)) * 1e3, 2),
            "mean_prompt_tokens": round(float(np.mean([t.prompt_tokens for t in rows])), 1),
            "mean_requests": round(float(np.mean([t.requests for t in rows])), 1),
            "steps_moving_kv": len(swapping),
            "mean_device_ms_moving_kv": round(float(np.mean(swapping)) * 1e3, 2) if swapping else None,
            "mean_device_ms_not_moving_kv": round(float(np.mean(quiet)) * 1e3, 2) if quiet else None,
            "blocks_in_out": [sum(t.swap_in_blocks for t in rows), sum(t.swap_out_blocks for t in rows)],
        }
    return buckets


def _steps_by_prompt_tokens(step_log: list[tuple[int, int, float]]) -> dict[str, dict[str, float]]:
    """The busy steps by how many prompt tokens they planned: how many, their mean, p99 and
    longest wall time (the engine overlaps a step with the next one's planning, so this is the
    step's share of the run: with async scheduling mostly the device time of the step before
    it, which device_by_prompt_tokens gives each step itself), and the mean number of requests
    running; to set against the step-time model that the fairness simulation uses, and the p99
    times between tokens."""
    return {label: {"steps": len(rows),
                    "mean_ms": round(sum(dt for *_, dt in rows) / len(rows) * 1e3, 2),
                    "p99_ms": round(float(np.percentile([dt for *_, dt in rows], 99)) * 1e3, 2),
                    "max_ms": round(max(dt for *_, dt in rows) * 1e3, 2),
                    "mean_prompt_tokens": round(sum(n for n, *_ in rows) / len(rows), 1),
                    "mean_running": round(sum(r for _, r, _ in rows) / len(rows), 1)}
            for label, rows in _by_prompt_tokens(step_log, lambda row: row[0])}


def _by_prompt_tokens(steps: list[T], prompt_tokens: Callable[[T], int]) -> Iterator[tuple[str, list[T]]]:
    """(label, steps) for each of STEP_BUCKETS that holds some of `steps`."""
    for low, high in STEP_BUCKETS:
        rows = [step for step in steps if low <= prompt_tokens(step) <= high]
        if rows:
            yield (f"{low}-{high}" if high < 1 << 30 else f">{low - 1}"), rows


def _swap_costs(engine: LLMEngine, config: FairnessBenchConfig, vocab: int) -> dict[str, Any]:
    """Resuming a `resume_tokens`-token request: its blocks copied back from the host pool,
    against its prompt computed again (the time to its first token alone); and pinned copies of
    1 GiB each way, the ceiling the swaps are held to."""
    swapper, device = engine.runner.swapper, engine.device
    num_blocks = -(-config.resume_tokens // engine.blocks.block_size)
    pairs = [(i, i) for i in range(num_blocks)]
    for _ in range(3):
        swapper.before_step(pairs, [])
        swapper.before_step([], pairs)
        swapper.before_step([], [])
    _sync(device)
    start = time.perf_counter()
    swapper.before_step([], pairs)
    swapper.before_step([], [])
    _sync(device)
    swap_in_s = time.perf_counter() - start
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    for i in range(3):  # a new prompt each time: a repeated one would come from the prefix cache
        prompt = np.random.default_rng(i + 1).integers(FIRST_TOKEN, vocab, config.resume_tokens).tolist()
        started = time.perf_counter()
        engine.add_request(f"resume-{i}", prompt_token_ids=prompt, params=params, adapter="light-1")
        while engine.has_unfinished_requests():
            engine.step()
        engine.drain()
        recompute_s = time.perf_counter() - started
    ceiling = {}
    if device.type == "cuda":
        gib = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        for name, dst, src in (("device_to_host", host, gib), ("host_to_device", gib, host)):
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            ceiling[name + "_gb_per_s"] = round((1 << 30) / (time.perf_counter() - start) / 1e9, 1)
    block_bytes = swapper.block_bytes
    return {
        "resume_tokens": config.resume_tokens, "swap_in_s": round(swap_in_s, 5),
        "swap_in_gb_per_s": round(num_blocks * block_bytes / swap_in_s / 1e9, 1),
        "recompute_s": round(recompute_s, 5), "swap_in / recompute": round(swap_in_s / recompute_s, 3),
        "pinned_copy_ceiling": ceiling,
    }


def plot(json_path: Path, png_path: Path) -> None:
    """Light tenants' time to first token by policy, each tenant's service under VTC, and the
    swaps against the pinned-copy ceiling (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(json_path.read_text())
    runs, swap = result["runs"], result["swap"]
    fig, (ttft, share, swaps) = plt.subplots(1, 3, figsize=(15, 4.2))
    names = list(runs)
    for offset, (pct, color) in enumerate((("p50", "tab:blue"), ("p99", "tab:red"))):
        values = [runs[name]["light"][f"ttft_{pct}_s"] for name in names]
        ttft.bar([i + 0.4 * offset for i in range(len(names))], values, 0.4, label=pct, color=color)
    ttft.set_xticks([i + 0.2 for i in range(len(names))], ["light alone", "FCFS", "VTC + swap"])
    ttft.set_yscale("log")
    ttft.set_ylabel("light tenants' time to first token (s)")
    ttft.legend()
    service = runs["vtc"]["tenant_service"]
    tenants = sorted(service)
    share.bar(tenants, [service[t] for t in tenants], color="tab:green")
    share.set_ylabel("VTC service (prompt + 2 x generated tokens)")
    share.set_title("light tenants get what they ask; the heavy one the rest")
    vtc, ceiling = runs["vtc"], swap["pinned_copy_ceiling"]
    labels = ["out", "in", "resume 2k"]
    measured = [vtc["swap_out_gb_per_s"] or 0, vtc["swap_in_gb_per_s"] or 0, swap["swap_in_gb_per_s"]]
    swaps.bar(labels, measured, color="tab:purple", label="swaps")
    if ceiling:
        swaps.axhline(ceiling["host_to_device_gb_per_s"], color="black", linestyle="--", label="pinned copy")
    swaps.set_ylabel("GB/s")
    swaps.set_title(f"resume by swap-in: {swap['swap_in / recompute']:.3f}x of recompute")
    swaps.legend()
    fig.suptitle(f"loraplex bench fairness, {result['device']}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

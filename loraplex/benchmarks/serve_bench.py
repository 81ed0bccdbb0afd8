"""`loraplex bench serve`: a running server (or one started here) driven through the OpenAI API
with streaming, the way vLLM's serving benchmark drives vLLM.

    loraplex bench serve [--url URL --admin-key KEY | --serve demo] [--setup FILE]
        [--num-prompts 500] [--request-rate inf] [--burstiness 1] [--max-concurrency N]
        [--prompt-len 256 --prompt-dist fixed|longtail] [--output-len 128 --output-dist ...]
        [--num-tenants 4] [--num-adapters 32] [--zipf-alpha 1.0] [--rank 8] [--seed 0]
        [--ttft-slo-ms 1000] [--tpot-slo-ms 100] [--time-limit S] [--tag NAME] [--out bench/results]

Requests (loraplex.benchmarks.serve_workload) arrive at `--request-rate` per second (Poisson, or
gamma with `--burstiness`), or all at once (inf), optionally at most `--max-concurrency` at a
time. Each is `POST /v1/completions` with token-id prompts, `stream: true`, `ignore_eos` (the
output length is exact) and `stream_options.continuous_usage_stats` (each chunk says how many
tokens it brings), sent with its tenant's own key for one of its adapters; adapters are picked
with Zipf popularity. Setting up: with an admin key, tenants `t000...` are created with a key
each, and adapters `a0000...` (random PEFT LoRA adapters of `--rank` on all seven projections,
for the served model's shape) uploaded through the admin API unless they exist; `--setup FILE`
instead names a JSON file with the keys (written by loraplex.benchmarks.synthetic_server).

Reported: request and output-token throughput, TTFT, TPOT and ITL at p50/p90/p99 (and mean),
goodput (requests per second within both SLOs), errors by HTTP status, and the engine's own
counters over the run from /metrics (adapter slot hits, cold loads into the host tier and into
slots, preemptions, the server process's CPU seconds per generated token). JSON and a plot go to
`<out>/serve-<tag>.json|png`; a progress bar runs on stderr."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loraplex.benchmarks.results import RESULTS
from loraplex.benchmarks.serve_workload import (
    BenchRequest,
    WorkloadConfig,
    adapter_name,
    adapter_owner,
    make_workload,
    tenant_name,
)

TIME_LIMIT_STATUS = -1
"""RequestResult.status of a request dropped at --time-limit (0: no HTTP answer)."""
PEFT_BLOCKS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
ENGINE_COUNTERS = {
    "lora_requests": "loraplex:lora_requests_total",
    "adapter_host_loads": "loraplex:lora_host_loads_total",
    "adapter_slot_loads": "loraplex:lora_slot_loads_total",
    "preemptions": "vllm:num_preemptions_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "server_cpu_s": "process_cpu_seconds_total",
}
"""Counters read from /metrics before and after a run (the run's figure is the difference)."""
LABELED_COUNTERS = {
    "engine_thread_cpu_s": ("loraplex:thread_cpu_seconds_total", "thread", "engine"),
    "event_loop_cpu_s": ("loraplex:thread_cpu_seconds_total", "thread", "event_loop"),
    "other_threads_cpu_s": ("loraplex:thread_cpu_seconds_total", "thread", "other"),
    "fairness_preemptions": ("loraplex:preemptions_total", "cause", "fairness"),
}
"""Counters read for one label value (the server's CPU time by thread; preemptions the tenants'
fair shares asked for, which requests that arrive over time cause and an offline run does not)."""
THREAD_COUNTERS = ("engine_thread_cpu_s", "event_loop_cpu_s", "other_threads_cpu_s")


@dataclass
class Target:
    """A server ready for the workload: its URL and a key for every tenant."""

    url: str
    model_id: str
    keys: dict[str, str]
    vocab_size: int
    admin_key: str | None = None


@dataclass
class RequestResult:
    index: int
    status: int
    ttft_s: float | None = None
    latency_s: float | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)
    """Time between consecutive chunks that brought tokens (ITL)."""
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.latency_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


# The client --------------------------------------------------------------------------------------
async def stream_completion(url: str, key: str, body: dict) -> RequestResult:
    """POST /v1/completions over a plain asyncio connection (HTTP/1.1, chunked), timing every
    chunk that brings tokens. A general-purpose client (httpx, openai) parses each chunk in much
    more Python, and on a small machine the client, not the server, would be measured."""
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    payload = json.dumps(body).encode()
    started = time.perf_counter()
    result = RequestResult(-1, 0)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                     % (host.encode(), key.encode(), len(payload)) + payload)
        head = await reader.readuntil(b"\r\n\r\n")
        result.status = int(head.split(b" ", 2)[1])
        if result.status != 200:
            result.error = (await reader.read())[:300].decode(errors="replace")
            return result
        buffer, last_at, tokens = b"", None, 0
        while True:  # chunked transfer encoding: a hex size line, the data, CRLF
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                break
            buffer += (await reader.readexactly(size + 2))[:-2]
            *events, buffer = buffer.split(b"\n\n")
            now = time.perf_counter()
            for event in events:
                if not event.startswith(b"data: {"):
                    continue
                chunk = json.loads(event[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])[:300]
                    continue
                usage = chunk.get("usage") or {}
                count = usage.get("completion_tokens", tokens)
                if count > tokens:
                    if last_at is None:
                        result.ttft_s = now - started
                    else:
                        result.chunk_gaps_s.append(now - last_at)
                    last_at, tokens = now, count
        result.output_tokens = tokens
        result.latency_s = time.perf_counter() - started
        return result
    finally:
        writer.close()


async def run_requests(target: Target, requests: list[BenchRequest], max_concurrency: int | None,
                       progress: Progress, time_limit_s: float | None = None
                       ) -> tuple[list[RequestResult], float]:
    """Every request's result, and the time they took. Past `time_limit_s` the requests still
    going (or not yet sent) are dropped: they fail with TIME_LIMIT_STATUS."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def one(request: BenchRequest) -> RequestResult:
        delay = request.arrival_s - (time.perf_counter() - started)
        if delay > 0:
            await asyncio.sleep(delay)
        body = {"model": request.adapter or target.model_id, "prompt": request.prompt_token_ids,
                "max_tokens": request.max_tokens, "stream": True, "ignore_eos": True, "temperature": 0.0,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        async with limit:
            try:
                result = await stream_completion(target.url, target.keys[request.tenant], body)
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                result = RequestResult(-1, 0, error=f"{type(exc).__name__}: {exc}")
        result.index = request.index
        progress.advance(result.status == 200 and not result.error)
        return result

    started = time.perf_counter()
    tasks = [asyncio.ensure_future(one(r)) for r in requests]
    _, late = await asyncio.wait(tasks, timeout=time_limit_s)
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    duration = time.perf_counter() - started
    results = []
    for request, task in zip(requests, tasks):
        if task in late:
            results.append(RequestResult(request.index, TIME_LIMIT_STATUS,
                                         error=f"time limit ({time_limit_s} s)"))
        else:
            results.append(task.result())
    return results, duration


class Progress:
    """A progress bar on stderr (tqdm's when it is installed)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.done, self.failed, self.label = total, 0, 0, label
        self._started = time.perf_counter()
        self._shown = 0.0
        try:
            from tqdm import tqdm

            self._bar: Any = tqdm(total=total, desc=label, unit="req", file=sys.stderr)
        except ImportError:
            self._bar = None

    def advance(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        if self._bar is not None:
            self._bar.update(1)
            if not ok:
                self._bar.set_postfix(failed=self.failed)
            return
        now = time.perf_counter()
        if now - self._shown > 0.5 or self.done == self.total:
            self._shown = now
            filled = int(30 * self.done / self.total)
            print(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                  f"{now - self._started:.0f} s, {self.failed} failed", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            print(file=sys.stderr)


# The report --------------------------------------------------------------------------------------
def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    array = np.asarray(values) * scale
    return {"mean": round(float(array.mean()), 2),
            **{f"p{q}": round(float(np.percentile(array, q)), 2) for q in (50, 90, 99)}}


def report(results: list[RequestResult], duration_s: float, requests: list[BenchRequest],
           ttft_slo_s: float, tpot_slo_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200 and not r.error and r.ttft_s is not None]
    errors: dict[str, int] = {}
    for r in results:
        if r not in ok:
            key = str(r.status) if r.status > 0 else "time_limit" if r.status == TIME_LIMIT_STATUS \
                else "connection"
            errors[key] = errors.get(key, 0) + 1
    good = [r for r in ok if r.ttft_s <= ttft_slo_s and (r.tpot_s is None or r.tpot_s <= tpot_slo_s)]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(len(requests[r.index].prompt_token_ids) for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "errors_by_status": errors,
        "error_samples": [r.error for r in results if r.error][:5],
        "duration_s": round(duration_s, 3),
        "request_throughput": round(len(ok) / duration_s, 3),
        "output_throughput": round(output_tokens / duration_s, 1),
        "total_token_throughput": round((output_tokens + prompt_tokens) / duration_s, 1),
        "output_tokens": output_tokens, "prompt_tokens": prompt_tokens,
        "ttft_ms": percentiles([r.ttft_s for r in ok]),
        "tpot_ms": percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": percentiles([gap for r in ok for gap in r.chunk_gaps_s]),
        "e2e_ms": percentiles([r.latency_s for r in ok]),
        "slo": {"ttft_ms": ttft_slo_s * 1000, "tpot_ms": tpot_slo_s * 1000},
        "goodput_requests_per_s": round(len(good) / duration_s, 3),
        "good_fraction": round(len(good) / len(results), 4),
    }


def scrape_counters(url: str) -> dict[str, float]:
    """The engine counters (ENGINE_COUNTERS) from /metrics, summed over their label sets, and
    LABELED_COUNTERS."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    wanted = {metric: name for name, metric in ENGINE_COUNTERS.items()}
    labeled = {(metric, label, value): name for name, (metric, label, value) in LABELED_COUNTERS.items()}
    values = dict.fromkeys([*ENGINE_COUNTERS, *LABELED_COUNTERS], 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                values[wanted[sample.name]] += sample.value
            for label, value in sample.labels.items():
                if (name := labeled.get((sample.name, label, value))) is not None:
                    values[name] += sample.value
    return values


def engine_counters(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    delta = {name: round(after[name] - before[name], 3) for name in [*ENGINE_COUNTERS, *LABELED_COUNTERS]}
    tokens = delta["generation_tokens"]
    delta["adapter_slot_hits"] = max(0.0, delta["lora_requests"] - delta["adapter_slot_loads"])
    for name in ("server_cpu_s", *THREAD_COUNTERS):  # server_cpu_s -> server_cpu_ms_per_token
        delta[f"{name.removesuffix('_s')}_ms_per_token"] = \
            round(1000 * delta[name] / tokens, 4) if tokens else None
    return delta


# Setting up the server ---------------------------------------------------------------------------
def random_peft_adapter(shape: dict[str, int], rank: int, seed: int) -> tuple[bytes, bytes]:
    """(adapter_config.json, adapter_model.safetensors) of a random LoRA adapter on all seven
    projections of a model of `shape` (BaseModelShape's fields): a few percent of each
    projection's output, like a trained adapter."""
    from safetensors.numpy import save

    from loraplex.adapter_format import BaseModelShape

    base = BaseModelShape(**shape)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(base.num_layers):
        for module, block in PEFT_BLOCKS.items():
            in_features, out_features = base.features(module)
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, in_features)) /
                                                  math.sqrt(in_features)).astype(np.float16)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((out_features, rank)) *
                                                  0.02 / math.sqrt(rank)).astype(np.float16)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
              "target_modules": list(PEFT_BLOCKS), "bias": "none", "lora_dropout": 0.0}
    return json.dumps(config).encode(), save(tensors)


def prepare(url: str, admin_key: str, workload: WorkloadConfig, rank: int) -> Target:
    """Tenants with a fresh key each, and the workload's adapters uploaded (unless present)."""
    import httpx

    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=120) as http:
        engine = http.get("/admin/api/engine").raise_for_status().json()
        keys = {}
        for i in range(workload.num_tenants):
            name = tenant_name(i)
            created = http.post("/admin/api/tenants", json={"name": name})
            if created.status_code != 409:
                created.raise_for_status()
            key = http.post("/admin/api/keys", json={"tenant": name}).raise_for_status()
            keys[name] = key.json()["secret"]
        uploaded = 0
        for j in range(workload.num_adapters):
            tenant, name = adapter_owner(j, workload.num_tenants), adapter_name(j)
            if http.get(f"/admin/api/adapters/{tenant}/{name}").status_code == 200:
                continue
            config, weights = random_peft_adapter(engine["shape"], rank, seed=10_000 + j)
            http.post("/admin/api/adapters", data={"tenant": tenant, "name": name}, files={
                "adapter_config": ("adapter_config.json", config),
                "adapter_model": ("adapter_model.safetensors", weights)}).raise_for_status()
            uploaded += 1
        if uploaded:
            print(f"uploaded {uploaded} adapters of rank {rank}", file=sys.stderr)
    return Target(url, engine["model"], keys, engine["vocab_size"], admin_key)


def reset_prefix_cache(target: Target) -> int:
    """Have the server drop its cached prompt blocks; returns how many it dropped."""
    import httpx

    if target.admin_key is None:
        raise SystemExit("--reset-prefix-cache needs the admin key (--admin-key, or in --setup's file)")
    response = httpx.post(f"{target.url}/admin/api/engine/reset-prefix-cache", timeout=60,
                          headers={"Authorization": f"Bearer {target.admin_key}"})
    return response.raise_for_status().json()["dropped_blocks"]


def target_from_file(path: Path) -> Target:
    data = json.loads(path.read_text())
    return Target(data["url"], data["model_id"], data["keys"], data["vocab_size"], data.get("admin_key"))


@contextlib.contextmanager
def started_server(kind: str, data_dir: Path) -> Iterator[tuple[str, str]]:
    """`loraplex serve` on the demo, started here: (url, admin key)."""
    from loraplex.benchmarks.server_load import serve_demo

    if kind != "demo":
        raise SystemExit(f"--serve {kind}: only `demo` is started here (see synthetic_server for the GPU)")
    log = data_dir.parent / "loraplex-bench-serve.log"
    with serve_demo(data_dir, log) as url:
        yield url, (data_dir / "admin-api-key").read_text().strip()


# Running -----------------------------------------------------------------------------------------
def run(target: Target, workload: WorkloadConfig, *, max_concurrency: int | None, ttft_slo_s: float,
        tpot_slo_s: float, label: str = "serve", time_limit_s: float | None = None) -> dict[str, Any]:
    requests = make_workload(workload)
    before = scrape_counters(target.url)
    progress = Progress(len(requests), label)
    try:
        results, duration = asyncio.run(run_requests(target, requests, max_concurrency, progress,
                                                     time_limit_s))
    finally:
        progress.close()
    after = scrape_counters(target.url)
    result = {
        "benchmark": "serve", "workload": _jsonable(asdict(workload)), "max_concurrency": max_concurrency,
        "time_limit_s": time_limit_s,
        "url": target.url, "model": target.model_id,
        **report(results, duration, requests, ttft_slo_s, tpot_slo_s),
        "engine": engine_counters(before, after),
        "client_machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "load_average_1min_before": round(os.getloadavg()[0], 2),
    }
    result["timeline"] = _timeline(results, requests)
    return result


def _timeline(results: list[RequestResult], requests: list[BenchRequest]) -> dict[str, list]:
    """Per request (for the plot): arrival, TTFT, mean ITL."""
    ok = [r for r in results if r.ttft_s is not None]
    return {"arrival_s": [round(requests[r.index].arrival_s, 3) for r in ok],
            "ttft_ms": [round(r.ttft_s * 1000, 2) for r in ok],
            "mean_itl_ms": [round(1000 * float(np.mean(r.chunk_gaps_s)), 3) if r.chunk_gaps_s else None
                            for r in ok]}


def _jsonable(value: dict) -> dict:
    return {k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in value.items()}


def plot(result: dict[str, Any], path: Path) -> None:
    """TTFT against arrival time, and the TTFT and ITL distributions (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = result["timeline"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.scatter(timeline["arrival_s"], timeline["ttft_ms"], s=6, alpha=0.6)
    left.set_xlabel("arrival (s after start)")
    left.set_ylabel("time to first token (ms)")
    left.set_yscale("log")
    left.grid(True, alpha=0.3)
    for label, values in (("TTFT", timeline["ttft_ms"]),
                          ("mean ITL per request", [v for v in timeline["mean_itl_ms"] if v is not None])):
        if values:
            ordered = np.sort(values)
            right.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=label)
    right.set_xscale("log")
    right.set_xlabel("ms")
    right.set_ylabel("fraction of requests")
    right.grid(True, which="both", alpha=0.3)
    right.legend()
    w = result["workload"]
    fig.suptitle(f"{result['model']}: {w['num_prompts']} requests at {w['request_rate']}/s, "
                 f"{w['num_adapters']} adapters over {w['num_tenants']} tenants: "
                 f"{result['output_throughput']} output tok/s, p99 TTFT {result['ttft_ms']['p99']} ms",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    defaults = WorkloadConfig()
    parser.add_argument("--num-prompts", type=int, default=defaults.num_prompts)
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second (default inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 is Poisson")
    parser.add_argument("--prompt-len", type=int, default=defaults.prompt_len)
    parser.add_argument("--prompt-dist", choices=("fixed", "longtail"), default="fixed")
    parser.add_argument("--max-prompt-len", type=int, default=defaults.max_prompt_len)
    parser.add_argument("--output-len", type=int, default=defaults.output_len)
    parser.add_argument("--output-dist", choices=("fixed", "longtail"), default="fixed")
    parser.add_argument("--max-output-len", type=int, default=defaults.max_output_len)
    parser.add_argument("--num-tenants", type=int, default=4)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--zipf-alpha", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)


def workload_config(args: argparse.Namespace, vocab_size: int) -> WorkloadConfig:
    return WorkloadConfig(
        num_prompts=args.num_prompts, request_rate=args.request_rate, burstiness=args.burstiness,
        prompt_len=args.prompt_len, prompt_dist=args.prompt_dist, max_prompt_len=args.max_prompt_len,
        output_len=args.output_len, output_dist=args.output_dist, max_output_len=args.max_output_len,
        num_tenants=args.num_tenants, num_adapters=args.num_adapters, zipf_alpha=args.zipf_alpha,
        vocab_size=vocab_size, seed=args.seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loraplex bench serve", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--url", help="a running server (with --admin-key, or --setup)")
    source.add_argument("--serve", choices=("demo",), help="start `loraplex serve` on the demo here")
    parser.add_argument("--admin-key", help="sets up tenants, keys and adapters through the admin API")
    parser.add_argument("--setup", type=Path, help="JSON with url, model_id, keys, vocab_size (as "
                        "loraplex.benchmarks.synthetic_server writes it) instead of setting up")
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/loraplex-bench-data"),
                        help="the demo's data dir with --serve demo")
    add_workload_options(parser)
    parser.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    parser.add_argument("--rank", type=int, default=8, help="rank of the adapters uploaded")
    parser.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=100.0)
    parser.add_argument("--tag", default="cpu-demo", help="results file: serve-<tag>.json")
    parser.add_argument("--time-limit", type=float, help="seconds; requests not done by then fail "
                        "(`time_limit` in errors_by_status) and the results are written all the same")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--reset-prefix-cache", action="store_true", help="have the server forget its "
                        "cached prompt blocks first (admin API), so that a workload sent before is "
                        "computed again")
    args = parser.parse_args(argv)

    with contextlib.ExitStack() as stack:
        if args.setup is not None:
            target = target_from_file(args.setup)
        else:
            if args.serve is not None:
                url, admin_key = stack.enter_context(started_server(args.serve, args.data_dir))
            elif args.url is not None and args.admin_key is not None:
                url, admin_key = args.url.rstrip("/"), args.admin_key
            else:
                parser.error("give --setup FILE, --url URL with --admin-key KEY, or --serve demo")
            probe = WorkloadConfig(num_tenants=args.num_tenants, num_adapters=args.num_adapters)
            target = prepare(url, admin_key, probe, args.rank)
        workload = workload_config(args, target.vocab_size)
        if args.reset_prefix_cache:
            reset_prefix_cache(target)
        result = run(target, workload, max_concurrency=args.max_concurrency,
                     ttft_slo_s=args.ttft_slo_ms / 1000, tpot_slo_s=args.tpot_slo_ms / 1000, label=args.tag,
                     time_limit_s=args.time_limit)
    result["tag"] = args.tag
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"serve-{args.tag}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: v for k, v in result.items() if k not in ("timeline", "workload", "error_samples")}
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")
    if not args.no_plot:
        try:
            plot(result, path.with_suffix(".png"))
            print(f"wrote {path.with_suffix('.png')}")
        except ImportError:
            print("matplotlib is not installed: no plot", file=sys.stderr)
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())


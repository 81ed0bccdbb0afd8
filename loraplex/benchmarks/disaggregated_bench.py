"""`loraplex bench disaggregated` (issue 23): disaggregated prefill and decode on two GPUs against
two colocated replicas on the same two GPUs, under the same Poisson arrivals.

Llama-3-8B shape with random weights (bf16, CUDA graphs), 1,000 rank-16 adapters over 40
tenants (Zipf 1.0), long-tailed prompts (log-normal, median 2K tokens by default) and 256
generated tokens. At each request rate, every placement gets the same requests (the serving
benchmark's workload, loraplex/benchmarks/serve_workload.py); a request's TTFT is from its
arrival to its first token, its TPOT the mean gap between its later tokens. A placement's
goodput is the highest rate tried at which the TTFT and TPOT p90 meet their targets (issue 23:
1 s and 50 ms). Placements:

- `colocated`: two engines, one a GPU (each in a worker process, as the disaggregated sides
  are), each request sent to the one with fewer unfinished requests;
- `1:1`: DisaggregatedEngine (prefill on GPU 0, decode on GPU 1, each side stepping on its own
  thread, the decode side copying KV blocks out of the prefill side's cache).

Also measured in the same run: the GPU-to-GPU bandwidth (a 1 GiB device copy), and the KV
transfers' (their bytes over their seconds at each rate; the first runs' files also give the
median of each transfer's). On a CPU, `--smoke` runs the same on a tiny model with gloo workers
in seconds (what its test runs)."""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loraplex.benchmarks import synthetic
from loraplex.benchmarks.results import RESULTS, write
from loraplex.benchmarks.serve_workload import BenchRequest, WorkloadConfig, make_workload
from loraplex.benchmarks.synthetic_server import AdapterSet, synthetic_adapters, synthetic_digest
from loraplex.engine.disaggregated import DisaggregatedEngine
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.stats import TransferStats
from loraplex.engine_config import EngineConfig
from loraplex.types import SamplingParams

PLACEMENTS = ("colocated", "1:1")
SMOKE_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
               "max_position_embeddings": 1024}
IDLE_S = 0.001


@dataclass
class Timing:
    """One request's times (perf_counter seconds)."""

    arrival: float
    first: float | None = None
    last: float | None = None
    num_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.first - self.arrival

    @property
    def tpot(self) -> float | None:
        return (self.last - self.first) / (self.num_tokens - 1) if self.num_tokens > 1 else None


@dataclass
class Replica:
    """An engine stepped on a thread of its own, fed from its inbox."""

    engine: Any
    inbox: deque = field(default_factory=deque)
    unfinished: int = 0
    error: BaseException | None = None


def run_rate(replicas: list[Replica], requests: list[BenchRequest], tag: str) -> dict[str, Timing]:
    """Send `requests` at their arrival times (each to the replica with the fewest unfinished),
    step every replica on its own thread until all finish; each request's timing."""
    timings: dict[str, Timing] = {}
    done = threading.Event()
    pending = [len(requests)]
    lock = threading.Lock()

    def serve(replica: Replica) -> None:
        try:
            while not done.is_set():
                while replica.inbox:
                    request_id, request = replica.inbox.popleft()
                    replica.engine.add_request(
                        request_id, prompt_token_ids=request.prompt_token_ids, tenant=request.tenant,
                        adapter=_digest(request), params=SamplingParams(max_tokens=request.max_tokens,
                                                                        temperature=0.0, ignore_eos=True))
                if not replica.engine.has_unfinished_requests():
                    time.sleep(IDLE_S)
                    continue
                outputs = replica.engine.step()
                now = time.perf_counter()
                for output in outputs:
                    if output.error is not None:
                        raise RuntimeError(f"{output.request_id} failed: {output.error}")
                    timing = timings[output.request_id]
                    if output.new_token_ids:
                        timing.first = timing.first or now
                        timing.last = now
                        timing.num_tokens += len(output.new_token_ids)
                    if output.finished:
                        replica.unfinished -= 1
                        with lock:
                            pending[0] -= 1
                            if pending[0] == 0:
                                done.set()
        except BaseException as exc:  # noqa: BLE001 (raised by the caller)
            replica.error = exc
            done.set()

    threads = [threading.Thread(target=serve, args=(r,), daemon=True) for r in replicas]
    for thread in threads:
        thread.start()
    started = time.perf_counter()
    for request in requests:
        delay = started + request.arrival_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        request_id = f"{tag}-{request.index}"
        timings[request_id] = Timing(time.perf_counter())
        replica = min(replicas, key=lambda r: r.unfinished)
        replica.unfinished += 1
        replica.inbox.append((request_id, request))
    done.wait()
    for thread in threads:
        thread.join()
    for replica in replicas:
        if replica.error is not None:
            raise replica.error
    return timings


def _digest(request: BenchRequest) -> str | None:
    return None if request.adapter is None else synthetic_digest(int(request.adapter[1:]))


def summarize(timings: dict[str, Timing], rate: float, slo_ttft: float, slo_tpot: float) -> dict[str, Any]:
    ttfts = np.array([t.ttft for t in timings.values()])
    tpots = np.array([t.tpot for t in timings.values() if t.tpot is not None])
    both = [t.ttft <= slo_ttft and (t.tpot is None or t.tpot <= slo_tpot) for t in timings.values()]
    duration = max(t.last for t in timings.values()) - min(t.arrival for t in timings.values())
    row = {"rate": rate, "requests": len(timings), "duration_s": round(duration, 2),
           "ttft_p50_s": _percentile(ttfts, 50), "ttft_p90_s": _percentile(ttfts, 90),
           "ttft_p99_s": _percentile(ttfts, 99), "tpot_p50_s": _percentile(tpots, 50),
           "tpot_p90_s": _percentile(tpots, 90), "tpot_p99_s": _percentile(tpots, 99),
           "attained": round(sum(both) / len(both), 3),
           "output_tokens_per_s": round(sum(t.num_tokens for t in timings.values()) / duration, 1)}
    row["meets_targets"] = bool(row["ttft_p90_s"] <= slo_ttft and row["tpot_p90_s"] <= slo_tpot)
    return row


def _percentile(values: np.ndarray, q: float) -> float:
    return round(float(np.percentile(values, q)), 4) if len(values) else math.nan


def goodput(rows: list[dict[str, Any]], ttft_s: float | None = None, tpot_s: float | None = None) -> float:
    """The highest rate whose run met both p90 targets (the run's own, or these; 0 if none)."""
    def meets(row: dict[str, Any]) -> bool:
        if ttft_s is None:
            return row["meets_targets"]
        return row["ttft_p90_s"] <= ttft_s and row["tpot_p90_s"] <= tpot_s

    return max((row["rate"] for row in rows if meets(row)), default=0.0)


OTHER_TARGETS = ((1.0, 0.025), (2.0, 0.05))
"""Other (TTFT, TPOT) p90 targets whose goodput the summary gives from the same runs: a tight
TPOT, where disaggregation should pay (DistServe), and a loose TTFT."""


def gpu_bandwidth(num_bytes: int = 1 << 30, iterations: int = 10) -> dict[str, Any]:
    """GB/s of a device-to-device copy from GPU 0 to GPU 1, and the devices' peer access."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device="cuda:0")
    target = torch.empty(num_bytes, dtype=torch.uint8, device="cuda:1")
    target.copy_(source)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    started = time.perf_counter()
    for _ in range(iterations):
        target.copy_(source)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    seconds = (time.perf_counter() - started) / iterations
    del source, target
    torch.cuda.empty_cache()
    return {"bytes": num_bytes, "gb_per_s": round(num_bytes / seconds / 1e9, 1),
            "peer_access": torch.cuda.can_device_access_peer(0, 1)}


def _build(placement: str, config: EngineConfig, device: str) -> tuple[list[Replica], Any]:
    """The placement's replicas, and what to close after."""
    if placement == "1:1":
        engine = DisaggregatedEngine(config, processes=True, concurrent=True, random_weights=True)
        return [Replica(engine)], [engine]
    from loraplex.worker.workers import spawn_disaggregated  # (the worker side imports the engine)

    (first,), (second,) = spawn_disaggregated(
        1, 1, backend="nccl" if device == "cuda" else "gloo",
        num_threads=torch.get_num_threads() if device == "cuda" else 1)
    engines: list[LLMEngine | None] = [None, None]
    errors: list[BaseException] = []

    def build(i: int, workers: Any) -> None:
        try:
            engines[i] = LLMEngine(config, workers=workers, random_weights=True)
        except BaseException as exc:  # noqa: BLE001 (raised below)
            errors.append(exc)

    threads = [threading.Thread(target=build, args=(i, w)) for i, w in enumerate((first, second))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        for engine in engines:
            if engine is not None:
                engine.close()
        first.close()
        second.close()
        raise errors[0]
    return [Replica(engine) for engine in engines], engines


def run(args: argparse.Namespace) -> dict[str, Any]:
    overrides = SMOKE_MODEL if args.smoke else json.loads(args.model)
    result: dict[str, Any] = {
        "benchmark": "disaggregated", "config": {k: str(v) if isinstance(v, Path) else v
                                                 for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "targets": {"ttft_p90_s": args.slo_ttft, "tpot_p90_s": args.slo_tpot},
        "placements": {}}
    if args.device == "cuda":
        result["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        result["gpu_to_gpu"] = gpu_bandwidth()
        print(f"GPU 0 -> GPU 1 copy: {result['gpu_to_gpu']}", flush=True)
    model_config = synthetic.model_config(overrides)
    spec = AdapterSet(args.num_adapters, args.num_tenants, (args.rank,),
                      json.dumps(overrides, sort_keys=True), args.dtype, args.device)
    adapters = synthetic_adapters(spec)
    with tempfile.TemporaryDirectory(prefix="loraplex-pd-bench-") as folder:
        (Path(folder) / "config.json").write_text(json.dumps({**synthetic.LLAMA3_8B, **overrides}))
        config = EngineConfig.from_kwargs(
            folder, device=args.device, dtype=args.dtype,
            max_model_len=args.max_prompt_len + args.output_len + 16,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_lora_rank=args.rank, enable_prefix_caching=False)
        for placement in args.placements:
            started = time.perf_counter()
            replicas, closing = _build(placement, config, args.device)
            built_s = time.perf_counter() - started
            print(f"{placement}: built in {built_s:.1f} s", flush=True)
            rows = []
            try:
                for replica in replicas:
                    replica.engine.set_adapter_loader(adapters.load)
                warm = make_workload(_workload(args, model_config, rate=math.inf, num_prompts=16, seed=99))
                run_rate(replicas, warm, f"{placement}-warm")
                for rate in args.rates:
                    requests = make_workload(_workload(args, model_config, rate))
                    before = _prefill_side(replicas[0].engine)
                    sent = _transfers(replicas[0].engine)
                    row = summarize(run_rate(replicas, requests, f"{placement}-{rate}"), rate,
                                    args.slo_ttft, args.slo_tpot)
                    if placement == "1:1":
                        row["kv_transfers"] = _transfers_since(sent, _transfers(replicas[0].engine))
                        row["prefill_side"] = _prefill_use(before, _prefill_side(replicas[0].engine),
                                                           row["duration_s"])
                    print(f"{placement} at {rate} req/s: {json.dumps(row)}", flush=True)
                    rows.append(row)
            finally:
                for engine in closing:
                    engine.close()
            result["placements"][placement] = {"build_s": round(built_s, 1), "rows": rows,
                                               "goodput_req_per_s": goodput(rows)}
    result["summary"] = _summary(result)
    return result


def _workload(args: argparse.Namespace, model_config: Any, rate: float, num_prompts: int | None = None,
              seed: int = 0) -> WorkloadConfig:
    return WorkloadConfig(
        num_prompts=num_prompts or max(1, round(rate * args.duration_s)), request_rate=rate,
        prompt_len=args.prompt_len, prompt_dist="longtail", max_prompt_len=args.max_prompt_len,
        output_len=args.output_len, num_tenants=args.num_tenants, num_adapters=args.num_adapters,
        zipf_alpha=1.0, vocab_size=model_config.vocab_size, seed=seed)


def _prefill_side(engine: Any) -> tuple[float, int]:
    """(busy seconds, prompt tokens computed) of a disaggregated engine's prefill side."""
    if not isinstance(engine, DisaggregatedEngine):
        return 0.0, 0
    return engine.prefill_busy_s, engine.prefill.num_prompt_tokens


def _prefill_use(before: tuple[float, int], after: tuple[float, int], duration_s: float) -> dict[str, float]:
    """How busy the prefill side was over a run, and its prompt tokens per busy second."""
    busy, tokens = after[0] - before[0], after[1] - before[1]
    return {"busy_share": round(busy / duration_s, 3), "prompt_tokens": tokens,
            "prompt_tokens_per_busy_s": round(tokens / busy, 1) if busy > 0 else 0.0}


def _transfers(engine: Any) -> TransferStats:
    """A disaggregated engine's KV transfers so far (none for a colocated replica)."""
    return engine.transfers.snapshot() if isinstance(engine, DisaggregatedEngine) else TransferStats()


def _transfers_since(before: TransferStats, after: TransferStats) -> dict[str, Any]:
    """The KV transfers between two snapshots: their number, bytes, GB/s over all of them."""
    count, num_bytes = after.num_transfers - before.num_transfers, after.num_bytes - before.num_bytes
    if not count:
        return {"transfers": 0}
    seconds = after.seconds - before.seconds
    return {"transfers": count, "bytes": num_bytes, "seconds": seconds,
            "gb_per_s": round(num_bytes / seconds / 1e9, 2), "mean_mb": round(num_bytes / count / 1e6, 1)}


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    placements = result["placements"]
    summary: dict[str, Any] = {name: p["goodput_req_per_s"] for name, p in placements.items()}
    for ttft_s, tpot_s in OTHER_TARGETS:
        summary[f"goodput_at_ttft_{ttft_s:g}s_tpot_{tpot_s * 1000:g}ms"] = {
            name: goodput(p["rows"], ttft_s, tpot_s) for name, p in placements.items()}
    if placements.get("colocated", {}).get("goodput_req_per_s") and "1:1" in placements:
        summary["goodput_ratio"] = round(placements["1:1"]["goodput_req_per_s"]
                                         / placements["colocated"]["goodput_req_per_s"], 3)
    transfers = [row["kv_transfers"] for row in placements.get("1:1", {}).get("rows", [])
                 if row.get("kv_transfers", {}).get("transfers")]
    if transfers:
        num_bytes = sum(t["bytes"] for t in transfers)
        seconds = sum(t["seconds"] for t in transfers)  # (a row's GB/s is rounded: 0.0 on a slow CPU)
        summary["kv_transfer_gb_per_s"] = float(f"{num_bytes / seconds / 1e9:.3g}")  # (a CPU run's too)
        if "gpu_to_gpu" in result:
            summary["kv_transfer_share_of_gpu_to_gpu"] = round(
                summary["kv_transfer_gb_per_s"] / result["gpu_to_gpu"]["gb_per_s"], 3)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="loraplex bench disaggregated",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--placements", type=lambda t: tuple(t.split(",")), default=PLACEMENTS)
    parser.add_argument("--rates", type=lambda t: tuple(float(r) for r in t.split(",")),
                        default=(4.0, 8.0, 12.0), help="requests per second, comma-separated")
    parser.add_argument("--duration-s", type=float, default=15.0, help="seconds of arrivals at each rate")
    parser.add_argument("--prompt-len", type=int, default=2048, help="mean prompt tokens (log-normal)")
    parser.add_argument("--max-prompt-len", type=int, default=8192)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-adapters", type=int, default=1000)
    parser.add_argument("--num-tenants", type=int, default=40)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slo-ttft", type=float, default=1.0, help="TTFT p90 target, seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.05, help="TPOT p90 target, seconds")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--model", default="{}", help="JSON overrides of the Llama-3-8B shape")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model on the CPU, small loads (the benchmark's test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.dtype = "cpu", "float32"
        args.prompt_len, args.max_prompt_len, args.output_len = 24, 64, 6
        args.num_adapters, args.num_tenants, args.max_num_seqs, args.max_num_batched_tokens = 8, 2, 8, 64
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        parser.error(f"two GPUs are needed; {torch.cuda.device_count()} present")
    bad = set(args.placements) - set(PLACEMENTS)
    if bad:
        parser.error(f"unknown placements {sorted(bad)}; choose from {', '.join(PLACEMENTS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    path = write(result, args.out, "disaggregated")
    print(json.dumps(result["summary"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

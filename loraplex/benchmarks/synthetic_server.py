"""A `loraplex serve` for the serving benchmark on a GPU machine where nothing can be
downloaded: a Llama-3-8B-shaped model with random weights built on the device, a word-level
tokenizer over its whole vocabulary (one word, one token), a SQLite registry with the
workload's tenants (`t000`...) and a key each, and `--num-adapters` random adapters of `--rank`
on all seven projections (`a0000`..., adapter j owned by tenant j % num_tenants). With
`--ranks 8,16,64`, adapter j has rank ranks[j % 3] instead (equal shares; the workload's Zipf
popularity is shuffled over the indices, so each rank has hot and cold adapters) and the engine's
max_lora_rank is the largest.

    python -m loraplex.benchmarks.synthetic_server --port 8000 --setup setup.json \
        [--num-adapters 1000 --num-tenants 40 --rank 16 | --ranks 8,16,64] \
        [--max-loras 32 --max-num-seqs 128] [--offline WORKLOAD_JSON --out bench/results]

1,000 rank-16 adapters of that shape are 84 GB, more than the machine's disk; so adapter names
resolve here without the registry (the server's name cache makes the registry's part of it a
dictionary read either way), and the engine's loader, asked for adapter j, copies one of a few
random adapters of j's rank made at start-up into fresh pinned host memory under j's own digest:
the engine does all its usual work (host tier, slots, copies on the side stream, eviction), only
the blob store's file read is left out. Keys, tenants, limits and usage go through the real registry.

`--offline` first runs the workload (WorkloadConfig's fields as JSON) through the engine
directly, all at once, and writes `<out>/serve-offline-<device>.json` (the offline engine's
throughput on the same requests as `loraplex bench serve` with the same workload). Then the
server writes `--setup` (url, model_id, keys, vocab_size, admin_key; what `bench serve --setup`
reads) and serves until SIGTERM, which drains it (exit 0). After the offline pass and again after
the drain it writes `<out>/adapter-device-bytes.json`: by rank, the adapters resident on the
device then and their mean device bytes (what serve_report folds into serve-summary.json)."""

from __future__ import annotations

import argparse
import atexit
import functools
import hashlib
import json
import logging
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

import torch

from loraplex.benchmarks import synthetic
from loraplex.benchmarks.serve_report import DEVICE_BYTES_FILE
from loraplex.benchmarks.serve_workload import (
    WorkloadConfig,
    adapter_name,
    adapter_owner,
    make_workload,
    tenant_name,
)
from loraplex.benchmarks.step_timing import log_device_steps
from loraplex.cli.serve import use_engine_process
from loraplex.engine.core_client import EngineCoreClient, EngineView
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.lora_weights import HostAdapter
from loraplex.engine_config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from loraplex.kernels import engine_ops
from loraplex.registry.records import AdapterRecord
from loraplex.registry.registry_errors import AdapterNotFoundError
from loraplex.types import SamplingParams

MODEL_ID = "synthetic-llama-3-8b"
POOL_SIZE = 4
"""Distinct random adapters made at start-up for each rank; adapter j (of rank r, the k-th of
that rank) is a copy of pools[r][k % 4]."""
logger = logging.getLogger("loraplex.synthetic_server")


def synthetic_digest(index: int) -> str:
    return hashlib.sha256(f"loraplex-synthetic-adapter-{index}".encode()).hexdigest()


def parse_ranks(text: str) -> tuple[int, ...]:
    """`--ranks`: "8,16,64" -> (8, 16, 64), distinct positive ranks."""
    try:
        ranks = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ranks: {text!r}") from None
    if any(rank <= 0 for rank in ranks) or len(set(ranks)) != len(ranks):
        raise argparse.ArgumentTypeError(f"ranks must be positive and distinct: {text!r}")
    return ranks


class SyntheticAdapters:
    """What the server's AdapterNames does (names -> digests, digests -> adapters), for
    adapters that exist only as seeds. `pools` maps each rank to its random adapters, in the
    order that shares the adapters out: adapter j has the (j % len(pools))-th rank."""

    def __init__(self, num_adapters: int, num_tenants: int, pools: dict[int, list[HostAdapter]],
                 core: AdapterSet | None = None) -> None:
        """`core`: the set an engine-core process makes for itself and reads from (`locate`)."""
        self._pools, self._core = pools, core
        self.ranks = tuple(pools)
        self._num_tenants = num_tenants
        self._index = {synthetic_digest(j): j for j in range(num_adapters)}
        self._records = {(adapter_owner(j, num_tenants), adapter_name(j)): self._record(j)
                         for j in range(num_adapters)}

    def rank_of(self, j: int) -> int:
        return self.ranks[j % len(self.ranks)]

    def rank_of_digest(self, digest: str) -> int | None:
        """The rank of the synthetic adapter with `digest` (None for any other digest)."""
        j = self._index.get(digest)
        return None if j is None else self.rank_of(j)

    def _source(self, j: int) -> HostAdapter:
        pool = self._pools[self.rank_of(j)]
        return pool[j // len(self.ranks) % len(pool)]

    def _record(self, j: int) -> AdapterRecord:
        digest, rank = synthetic_digest(j), self.rank_of(j)
        nowhere = Path("/nonexistent")
        return AdapterRecord(
            id=j, tenant=adapter_owner(j, self._num_tenants), name=adapter_name(j), digest=digest,
            weights_sha256=digest, config_sha256=digest, weights_path=nowhere, config_path=nowhere,
            base_model=MODEL_ID, rank=rank, alpha=float(rank), target_modules=(
                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
            size_bytes=self.weight_bytes(rank), created_at=datetime.now(timezone.utc), num_requests_served=0)

    async def lookup(self, tenant: str, name: str) -> AdapterRecord:
        record = self._records.get((tenant, name))
        if record is None:
            raise AdapterNotFoundError(name)
        return record

    def forget(self, tenant: str, name: str | None = None) -> None:
        pass

    def names_of(self, digest: str) -> tuple[str, ...]:
        j = self._index.get(digest)
        return (digest,) if j is None else (adapter_name(j),)

    def load(self, digest: str) -> HostAdapter:
        """Runs on the engine's loader thread: a fresh pinned copy of a pool adapter of j's rank."""
        source = self._source(self._index[digest])

        def copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {group: torch.empty_like(t, pin_memory=t.is_pinned()).copy_(t)
                    for group, t in tensors.items()}

        return HostAdapter(digest, source.rank, copy(source.a), copy(source.b), copy(source.ranks))

    def locate(self, digest: str) -> functools.partial[HostAdapter]:
        """`--engine-process`: the core reads adapters itself, from the set it made (the blob
        store of this benchmark), as it would read a real server's blob files."""
        if self._core is None:
            raise RuntimeError("these synthetic adapters name no engine-core set to read from")
        self._index[digest]  # noqa: B018 - a digest that is not ours raises KeyError here
        return functools.partial(read_synthetic, self._core, digest)

    def weight_bytes(self, rank: int) -> int:
        """Bytes of the A and B weights of an adapter of `rank` (host memory, unpadded)."""
        return self._pools[rank][0].num_bytes


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer: token i is the word `w<i>` (decoded with spaces between)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    return EngineConfig(
        model=MODEL_ID, device=args.device, dtype=dtype, max_model_len=args.max_model_len, seed=0,
        cache=CacheConfig(block_size=16), mixed_step_graphs=args.mixed_step_graphs,
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  scheduler_delay_factor=args.scheduler_delay_factor,
                                  fairness_bound=args.fairness_bound,
                                  hold_places_for_loading=args.hold_places_for_loading),
        lora=LoRAConfig(max_lora_rank=max(args.ranks), max_loras=args.max_loras),
    )


def build_engine(args: argparse.Namespace, config: EngineConfig | None = None) -> LLMEngine:
    from loraplex.kernels import lora_paged

    lora_paged.SPLIT_LONE = args.split_lone  # (an experiment's switch: the kernels read it at launch)
    config = config or engine_config(args)
    device = torch.device(config.device)
    model_config = synthetic.model_config(args.model_overrides)
    started = time.perf_counter()
    model = synthetic.random_model(model_config, engine_ops(device), getattr(torch, config.dtype), device,
                                   args.max_model_len)
    engine = LLMEngine(config, model=model)
    engine.tokenizer = word_tokenizer(model_config.vocab_size)
    logger.info("engine built in %.1f s: %s", time.perf_counter() - started, engine.memory.describe())
    return engine


def make_pools(model_config: Any, dtype: torch.dtype, device: torch.device,
               ranks: tuple[int, ...]) -> dict[int, list[HostAdapter]]:
    """POOL_SIZE random adapters of each rank on `device` (pinned where it is a GPU's host); the
    first rank's seeds are 5000... (a single `--rank` gets the adapters it always had)."""
    pin = device.type == "cuda"
    return {rank: [synthetic.random_adapter(model_config, rank, dtype, device, f"pool-r{rank}-{i}",
                                            seed=5000 + 100 * k + i, pin=pin)
                   for i in range(POOL_SIZE)] for k, rank in enumerate(ranks)}


def prepare_engine(engine: LLMEngine, args: argparse.Namespace) -> SyntheticAdapters:
    """The engine's synthetic adapters and loader, its step log, and the offline pass (where
    asked): in the process that holds the engine."""
    adapters = synthetic_adapters(AdapterSet.of(args))
    engine.set_adapter_loader(adapters.load)
    if args.step_log is not None:
        atexit.register(log_steps(engine, args.step_log).close)
        device_log = args.step_log.with_name(f"{args.step_log.stem}-device{args.step_log.suffix}")
        atexit.register(log_device_steps(engine, device_log).close)
    if args.offline is not None:
        workload = WorkloadConfig(**(args.offline | {"vocab_size": engine.model_config.vocab_size}))
        result = run_offline(engine, workload)
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"serve-offline-{result['device'].replace(' ', '-').lower()}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result), flush=True)
        write_device_bytes(engine, adapters, args.out, "after the offline pass")
    return adapters


@dataclass(frozen=True)
class AdapterSet:
    """What a synthetic server's adapters are made from: their number, owners and ranks, and the
    model, dtype and device of their pools (seeded: a process that makes the set gets the same
    adapters)."""

    num_adapters: int
    num_tenants: int
    ranks: tuple[int, ...]
    model_overrides: str
    """synthetic.model_config's overrides, as JSON."""
    dtype: str
    device: str

    @classmethod
    def of(cls, args: argparse.Namespace) -> AdapterSet:
        return cls(args.num_adapters, args.num_tenants, tuple(args.ranks),
                   json.dumps(args.model_overrides, sort_keys=True), engine_config(args).dtype, args.device)


@functools.cache
def synthetic_adapters(spec: AdapterSet) -> SyntheticAdapters:
    """The adapters of `spec`, made once a process (the engine's loader, the offline pass and
    the reads that `locate` sends share them)."""
    model_config = synthetic.model_config(json.loads(spec.model_overrides))
    pools = make_pools(model_config, getattr(torch, spec.dtype), torch.device(spec.device), spec.ranks)
    return SyntheticAdapters(spec.num_adapters, spec.num_tenants, pools, core=spec)


def read_synthetic(spec: AdapterSet, digest: str) -> HostAdapter:
    """In the engine-core process: the adapter of `digest` from its own set."""
    return synthetic_adapters(spec).load(digest)


def build_core_engine(args: argparse.Namespace, config: EngineConfig) -> LLMEngine:
    """`--engine-process`: what the engine-core process runs to make its engine. Once the server
    starts, the core asks it for each adapter and reads it from its own set (`locate`), as
    `loraplex serve --engine-process` has its core read blob files."""
    engine = build_engine(args, config)
    prepare_engine(engine, args)
    return engine


def device_bytes_by_rank(engine: LLMEngine, adapters: SyntheticAdapters, when: str) -> dict[str, Any]:
    """The adapters resident on the device now, by rank: how many, their mean device bytes (their
    slots' pool pages), the mean over the rank (bytes per rank unit: the same for every rank
    when device bytes are proportional to rank) and the mean against the smallest rank's (None
    where either has no adapter resident)."""
    stats = engine.stats()
    sizes: dict[int, list[int]] = {rank: [] for rank in sorted(adapters.ranks)}
    for digest, num_bytes in (stats.adapter_device_bytes or {}).items():
        rank = adapters.rank_of_digest(digest)
        if rank is not None:
            sizes[rank].append(num_bytes)
    means = {rank: statistics.mean(values) for rank, values in sizes.items() if values}
    smallest = means.get(min(adapters.ranks))
    by_rank = {}
    for rank, values in sizes.items():
        mean = means.get(rank)
        by_rank[str(rank)] = {
            "num_resident": len(values), "mean_device_bytes": None if mean is None else round(mean),
            "device_bytes_per_rank": None if mean is None else round(mean / rank),
            "ratio_to_smallest_rank": None if mean is None or smallest is None else round(mean / smallest, 3),
            "weight_bytes": adapters.weight_bytes(rank)}
    return {"benchmark": "adapter-device-bytes", "when": when, "pool_page_bytes": stats.pool_page_bytes,
            "max_lora_rank": engine.config.lora.max_lora_rank, "by_rank": by_rank}


def write_device_bytes(engine: LLMEngine, adapters: SyntheticAdapters, out: Path, when: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    result = device_bytes_by_rank(engine, adapters, when)
    (out / DEVICE_BYTES_FILE).write_text(json.dumps(result, indent=1) + "\n")
    logger.info("device bytes by rank (%s): %s", when, json.dumps(result["by_rank"]))


def run_offline(engine: LLMEngine, workload: WorkloadConfig) -> dict[str, Any]:
    """The workload through the engine directly, every request added at once, on a thread of
    its own as the server runs the engine. (Measured on a busy two-core machine with the tiny
    smoke model: stepped from the main thread, where torch's CPU ops fork and join its intra-op
    OpenMP threads, the engine took 7.5 ms of CPU per token; from a worker thread 2.9, as with
    torch.set_num_threads(1) on the main thread 2.7: that made the offline pass slower than
    HTTP.)"""
    with ThreadPoolExecutor(1, thread_name_prefix="loraplex-offline") as pool:
        return pool.submit(_run_offline, engine, workload).result()


def _run_offline(engine: LLMEngine, workload: WorkloadConfig) -> dict[str, Any]:
    """The workload's adapters are loaded first, as the HTTP runs after this pass find them
    (resident, or in the host tier), so that the two paths are compared on the same adapter
    cache; the first pass's cold loads are the serving runs' own subject (Poisson over 1,000
    adapters against 32)."""
    requests = make_workload(workload)
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, request in enumerate(requests[:64]):  # prefill shapes (and the first adapter loads)
        engine.add_request(f"warm-{i}", prompt_token_ids=request.prompt_token_ids, params=warm,
                           adapter=_digest(request), tenant=request.tenant)
    _drain(engine)
    first_of = {request.adapter: request for request in requests if request.adapter}
    load = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    loaded = engine.stats()
    started = time.perf_counter()
    for name, request in first_of.items():  # every adapter of the workload, once
        engine.add_request(f"load-{name}", prompt_token_ids=request.prompt_token_ids[:16], params=load,
                           adapter=_digest(request), tenant=request.tenant)
    _drain(engine)
    warm_up = {"adapters": len(first_of), "seconds": round(time.perf_counter() - started, 3),
               "host_loads": engine.stats().num_adapter_host_loads - loaded.num_adapter_host_loads}
    engine.reset_prefix_cache()  # the warm-up computed some of the workload's prompts: not for free here
    before = engine.stats()
    cpu, started = time.process_time(), time.perf_counter()
    for request in requests:
        engine.add_request(
            f"offline-{request.index}", prompt_token_ids=request.prompt_token_ids, tenant=request.tenant,
            params=SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True),
            adapter=_digest(request))
    output_tokens = 0
    while engine.has_unfinished_requests():
        output_tokens += sum(len(o.new_token_ids) for o in engine.step())
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    duration, cpu = time.perf_counter() - started, time.process_time() - cpu
    after = engine.stats()
    return {
        "benchmark": "serve-offline", "workload": {k: ("inf" if v == float("inf") else v)
                                                  for k, v in workload.__dict__.items()},
        "completed": len(requests), "duration_s": round(duration, 3), "output_tokens": output_tokens,
        "request_throughput": round(len(requests) / duration, 3),
        "output_throughput": round(output_tokens / duration, 1),
        "engine_cpu_ms_per_token": round(1000 * cpu / output_tokens, 4),
        "adapter_host_loads": after.num_adapter_host_loads - before.num_adapter_host_loads,
        "adapter_slot_loads": after.num_adapter_slot_loads - before.num_adapter_slot_loads,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "preemptions_by_cause": _grown(before.preemptions, after.preemptions),
        "prefix_cache_hit_tokens": after.prefix_hit_tokens - before.prefix_hit_tokens,
        "warm_up": warm_up,
        "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
    }


def _grown(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What each counter gained (those that did)."""
    return {key: n - before.get(key, 0) for key, n in after.items() if n > before.get(key, 0)}


def _digest(request: Any) -> str | None:
    return synthetic_digest(int(request.adapter[1:])) if request.adapter else None


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def set_up_registry(data_dir: Path, engine: LLMEngine | EngineView,
                    num_tenants: int) -> tuple[Any, dict[str, str], str]:
    from loraplex.registry import Registry, RegistryConfig

    registry = Registry.open(RegistryConfig(data_dir=data_dir))
    registry.models.set(MODEL_ID, engine.model_config.shape, engine.config.lora.max_lora_rank)
    keys = {}
    for i in range(num_tenants):
        registry.tenants.create(tenant_name(i))
        keys[tenant_name(i)] = registry.keys.create(tenant=tenant_name(i)).secret
    return registry, keys, registry.keys.create(admin=True).secret


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; `ranks` is always set (`--ranks`, or the single `--rank`)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--setup", type=Path, required=True, help="where to write url and keys (JSON)")
    parser.add_argument("--data-dir", type=Path, help="registry folder (default: a temporary one)")
    parser.add_argument("--num-adapters", type=int, default=1000)
    parser.add_argument("--num-tenants", type=int, default=40)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--ranks", type=parse_ranks, help="comma-separated ranks shared out in turn "
                        "(adapter j has ranks[j %% len(ranks)]), each with its own random adapters; "
                        "default: --rank alone")
    parser.add_argument("--max-loras", type=int, default=None,
                        help="most adapters resident at once (default: no cap, as many as the pool holds)")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model-overrides", type=json.loads, default={},
                        help="JSON of config.json keys replacing the Llama-3-8B shape (CPU smoke runs)")
    parser.add_argument("--offline", type=json.loads, help="a workload (WorkloadConfig fields) to "
                        "run through the engine directly before serving")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--shutdown-timeout", type=int, default=60)
    parser.add_argument("--split-lone", action=argparse.BooleanOptionalAction, default=True,
                        help="lora_paged.SPLIT_LONE: in steps past 512 tokens, tokens whose neighbours "
                        "carry other adapters (decode rows) through the per-token LoRA kernels, "
                        "the rest in tiles (default on; off to measure without)")
    parser.add_argument("--mixed-step-graphs", action=argparse.BooleanOptionalAction,
                        default=EngineConfig.mixed_step_graphs,
                        help="EngineConfig.mixed_step_graphs: capture steps with prompt tokens too "
                        "(default %(default)s)")
    parser.add_argument("--scheduler-delay-factor", type=float,
                        default=SchedulerConfig.scheduler_delay_factor,
                        help="SchedulerConfig.scheduler_delay_factor (default %(default)s)")
    parser.add_argument("--fairness-bound", type=float, default=SchedulerConfig.fairness_bound,
                        help="SchedulerConfig.fairness_bound (default %(default)s)")
    parser.add_argument("--hold-places-for-loading", action=argparse.BooleanOptionalAction,
                        default=SchedulerConfig.hold_places_for_loading,
                        help="SchedulerConfig.hold_places_for_loading (default %(default)s)")
    parser.add_argument("--step-log", type=Path, help="write a CSV line a step here: when it started "
                        "(Unix time), its wall time, prompt tokens, running, waiting, waiting for an "
                        "adapter, and preemptions, host loads and slot loads so far; and beside it "
                        "(NAME-device.csv) a line a collected step: its own device time and what it "
                        "planned (prompt tokens, requests, KV blocks swapped in and out)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                        help="the engine in a process of its own (`loraplex serve --engine-process`): the "
                        "offline pass and the step log run there; the device bytes after the drain are "
                        "not written. Default as `loraplex serve`'s: on where the device is a GPU")
    parser.add_argument("--switch-interval-ms", type=float, help="sys.setswitchinterval for this "
                        "process (default: Python's 5 ms): how long the engine thread may wait for the "
                        "GIL while the event loop holds it")
    args = parser.parse_args(argv)
    args.ranks = args.ranks or (args.rank,)
    args.engine_process = use_engine_process(args.engine_process, args.device)
    return args


def log_steps(engine: LLMEngine, path: Path) -> TextIO:
    """Note every step of `engine` in `path` (CSV); returns the file, for the caller to close."""
    out = path.open("w", buffering=1)  # line by line: an engine-core process ends without atexit
    out.write("start_s,wall_ms,prompt_tokens,running,waiting,adapter_waits,preemptions,host_loads,"
              "slot_loads\n")
    step, scheduler, adapters = engine.step, engine.scheduler, engine.adapters

    def logged_step() -> list:
        started, clock, prompt = time.time(), time.perf_counter(), engine.num_prompt_tokens
        outputs = step()
        out.write(f"{started:.4f},{1e3 * (time.perf_counter() - clock):.2f},"
                  f"{engine.num_prompt_tokens - prompt},{len(scheduler.running)},{scheduler.num_waiting},"
                  f"{len(scheduler.adapter_waits)},{scheduler.num_preemptions},{adapters.num_host_loads},"
                  f"{adapters.num_slot_loads}\n")
        return outputs

    engine.step = logged_step
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)

    import uvicorn

    from loraplex.cli.serve import _configure_logging
    from loraplex.heap import freeze_startup_heap
    from loraplex.server import ServerConfig, create_app
    from loraplex.server.drain import DrainingServer

    _configure_logging()
    logging.getLogger("loraplex.server.usage_recorder").setLevel(logging.WARNING)  # names not in the registry
    if args.engine_process:
        engine = EngineCoreClient.start(engine_config(args), functools.partial(build_core_engine, args),
                                        word_tokenizer(synthetic.model_config(args.model_overrides).vocab_size))
        facts = engine.view
        # The server's adapters: names and records (on the host: no CUDA here); the core reads the
        # adapters it asks for from its own set (SyntheticAdapters.locate).
        pools = make_pools(facts.model_config, facts.dtype, torch.device("cpu"), args.ranks)
        adapters = SyntheticAdapters(args.num_adapters, args.num_tenants, pools, core=AdapterSet.of(args))
    else:
        engine = facts = build_engine(args)
        adapters = prepare_engine(engine, args)
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="loraplex-synthetic-"))
    registry, keys, admin_key = set_up_registry(data_dir, facts, args.num_tenants)
    url = f"http://{args.host}:{args.port}"
    args.setup.write_text(json.dumps({"url": url, "model_id": MODEL_ID, "keys": keys, "admin_key": admin_key,
                                      "vocab_size": facts.model_config.vocab_size}))
    app = create_app(ServerConfig(model_id=MODEL_ID, max_requests_in_flight=4096), registry, engine, adapters)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=args.shutdown_timeout),
                            drain_timeout_s=args.shutdown_timeout)
    logger.info("serving %s on %s with %d adapters of rank %s over %d tenants", MODEL_ID, url,
                args.num_adapters, "/".join(map(str, args.ranks)), args.num_tenants)
    freeze_startup_heap()
    server.run()  # (an engine-core process is stopped as the server's lifespan ends)
    if not args.engine_process:
        write_device_bytes(engine, adapters, args.out, "after the drain")
        engine.close()
    registry.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

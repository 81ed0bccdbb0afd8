"""Benchmarks of the Triton kernels at Llama-3-8B shapes (GPU only).

    loraplex bench kernels [--sweep] [--only REGEX] [--lora-baseline FILE] [--tag TAG]
                            [--paged [--tiny]] [--out bench/results]

Each case is timed by replaying a CUDA graph of many calls (as the engine runs them), cycling
over enough independent input sets that the inputs do not sit in L2 between calls; the figure
is the median over replays, per call. Achieved bandwidth = bytes that must move (each input
read once, each output written once) / time, printed next to the device's own copy bandwidth,
measured at start (loraplex.benchmarks.device_floors; 3.0 TB/s on the lent H100). Writes
bench/results/kernels-<gpu>.json; `--sweep` instead times alternative launch configs of decode
attention and LoRA (kernels-<gpu>-sweep.json).
`--only` keeps the cases whose names match a regular expression (`--only lora`);
`--lora-baseline` also times another implementation of lora.py (a file with the same
wrappers, e.g. `git show <commit>:kernels/lora.py > /tmp/lora_old.py`) on each LoRA case;
`--tag` goes into the JSON's name (kernels-<gpu>-<tag>[-sweep].json).
`--paged` instead compares a decode step's adapter work read through rank pages with today's
slots, per family (loraplex/benchmarks/paged_kernels.py; kernels-paged-<device>.json; on the
CPU, tiny, under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import re
import statistics
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType

import torch
import triton

from loraplex.benchmarks.device_floors import measure
from loraplex.benchmarks.results import RESULTS
from loraplex.kernels import activation, decode_attention, lora, norm, prefill_attention, rotary, token_mask
from loraplex.kernels import sampling as sampling_mod


def ceiling_bytes_per_s() -> float:
    """This GPU's device-copy bandwidth, measured once (loraplex.benchmarks.device_floors)."""
    return measure("cuda", "bfloat16").copy_bytes_per_s


def ceiling_flops() -> float:
    """This GPU's bf16 8192-cube product throughput, measured once."""
    return measure("cuda", "bfloat16").matmul_flops_per_s

L2_DEFEAT_BYTES = 160e6  # input sets cycled per graph: about 3x the 50 MB L2

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 4096, 32, 8, 128
INTERMEDIATE, VOCAB, BLOCK_SIZE = 14336, 128256, 16
DTYPE = torch.bfloat16
DEVICE = "cuda"


@dataclass
class Result:
    kernel: str
    case: str
    time_us: float
    bytes: float
    gbps: float
    fraction_of_ceiling: float
    flops: float = 0.0
    tflops: float = 0.0
    notes: dict = field(default_factory=dict)


def time_per_call(fn: Callable[[object], object], sets: list, *, min_calls: int = 64,
                  replays: int = 15) -> float:
    """Seconds per fn(set) call, from CUDA-graph replays of calls cycling over sets."""
    for s in sets:  # compile and warm up outside the capture
        fn(s)
    torch.cuda.synchronize()
    rounds = max(1, math.ceil(min_calls / len(sets)))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for s in sets:
            fn(s)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for s in sets:
                fn(s)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times) / (rounds * len(sets))


def num_sets(bytes_per_call: float) -> int:
    return max(1, min(32, math.ceil(L2_DEFEAT_BYTES / max(bytes_per_call, 1))))


def result(kernel: str, case: str, seconds: float, nbytes: float, flops: float = 0.0,
           **notes) -> Result:
    gbps = nbytes / seconds / 1e9
    return Result(kernel, case, seconds * 1e6, nbytes, gbps, nbytes / seconds / ceiling_bytes_per_s(),
                  flops, flops / seconds / 1e12 if flops else 0.0, notes)


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE, dtype=torch.float32) * scale).to(DTYPE)


# ---------------------------------------------------------------- elementwise ops


def bench_norm(num_tokens: int) -> Result:
    nbytes = num_tokens * HIDDEN * 2 * 4 + HIDDEN * 2
    sets = [(randn(num_tokens, HIDDEN), randn(num_tokens, HIDDEN), randn(HIDDEN))
            for _ in range(num_sets(nbytes))]
    t = time_per_call(lambda s: norm.fused_add_rms_norm(s[0], s[1], s[2], 1e-5), sets)
    return result("fused_add_rms_norm", f"tokens={num_tokens}", t, nbytes)


def bench_silu(num_tokens: int) -> Result:
    nbytes = num_tokens * INTERMEDIATE * 2 * 3
    sets = [randn(num_tokens, 2 * INTERMEDIATE) for _ in range(num_sets(nbytes))]
    t = time_per_call(activation.silu_and_mul, sets)
    return result("silu_and_mul", f"tokens={num_tokens}", t, nbytes)


def bench_rotary(num_tokens: int) -> Result:
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    # read q, k, v and a cos/sin row; write q and k, v into the cache
    nbytes = num_tokens * ((q_size + 2 * kv_size) * 2 * 2 + HEAD_DIM * 4 + 16)
    num_blocks = num_tokens // BLOCK_SIZE + 1
    cos_sin = torch.randn(8192, HEAD_DIM, device=DEVICE)

    def make():
        qkv = randn(num_tokens, q_size + 2 * kv_size)
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        cache = torch.empty(num_blocks, 2, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=DTYPE,
                            device=DEVICE)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:num_tokens]
        return (torch.randint(0, 8192, (num_tokens,), device=DEVICE),
                q.view(num_tokens, HEADS, HEAD_DIM), k.view(num_tokens, KV_HEADS, HEAD_DIM),
                v.view(num_tokens, KV_HEADS, HEAD_DIM), cache[:, 1], slots)

    sets = [make() for _ in range(num_sets(nbytes))]
    t = time_per_call(lambda s: rotary.rotary_store_kv(s[0], s[1], s[2], s[3], cos_sin, s[4],
                                                       s[5]), sets)
    return result("rotary_store_kv", f"tokens={num_tokens}", t, nbytes)


# ---------------------------------------------------------------- attention


def paged_cache(seq_lens: list[int], num_layers: int = 4):
    """A random block-major cache of num_layers layers (the layer-1 view is used, so block
    strides are the real interleaved ones) and shuffled block tables."""
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    cache = randn(num_blocks, num_layers, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    perm = torch.randperm(num_blocks, device=DEVICE).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=DEVICE)
    start = 0
    for i, nb in enumerate(blocks_per_seq):
        tables[i, :nb] = perm[start:start + nb]
        start += nb
    return cache[:, 1], tables


def kv_bytes(seq_lens: list[int]) -> int:
    return sum(seq_lens) * KV_HEADS * HEAD_DIM * 2 * 2


_INPUTS: dict[object, object] = {}  # inputs kept across the configs of a sweep


def decode_inputs(batch: int, context: int):
    if ("decode", batch, context) not in _INPUTS:
        _INPUTS.clear()
        seq_lens = [context] * batch
        kv_layer, tables = paged_cache(seq_lens)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        _INPUTS[("decode", batch, context)] = (randn(batch, HEADS, HEAD_DIM), kv_layer, tables,
                                               lens)
    return _INPUTS[("decode", batch, context)]


def bench_decode(batch: int, context: int, config: decode_attention.DecodeConfig | None = None
                 ) -> Result:
    nbytes = kv_bytes([context] * batch) + 2 * batch * HEADS * HEAD_DIM * 2
    q, kv_layer, tables, lens = decode_inputs(batch, context)
    if config is None:
        config = decode_attention.decode_config(batch, KV_HEADS, tables.shape[1] * BLOCK_SIZE,
                                                HEAD_DIM, q.device)
    run = lambda _: decode_attention._launch(q, kv_layer, tables, lens, HEAD_DIM ** -0.5, config)
    t = time_per_call(run, [None], min_calls=32)  # KV far larger than L2
    return result("paged_decode_attention", f"batch={batch} context={context}", t, nbytes,
                  flops=4.0 * batch * HEADS * HEAD_DIM * context, **asdict(config))


def bench_prefill(query_lens: list[int], context_lens: list[int],
                  config: prefill_attention.PrefillConfig | None = None) -> Result:
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    kv_layer, tables = paged_cache(seq_lens)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    q = randn(starts[-1], HEADS, HEAD_DIM)
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    # causal: each new token at position p attends to p + 1 keys
    keys = sum(sum(c + i + 1 for i in range(n)) for n, c in zip(query_lens, context_lens))
    flops = 4.0 * HEADS * HEAD_DIM * keys
    nbytes = kv_bytes(seq_lens) + 2 * starts[-1] * HEADS * HEAD_DIM * 2
    config = config or prefill_attention.prefill_config(HEADS // KV_HEADS, HEAD_DIM)
    run = lambda _: prefill_attention._launch(q, kv_layer, tables, qsl, lens, HEAD_DIM ** -0.5,
                                              True, config)
    t = time_per_call(run, [None], min_calls=8)
    return result("paged_attention", f"new={query_lens} context={context_lens}", t, nbytes, flops,
                  **asdict(config))


def bench_scattered_prefill(prompt_len: int, share: float, by_runs: bool = False) -> Result:
    """A blend's recompute (loraplex/engine/blending.py): `share` of a prompt's tokens, scattered,
    every key cached, as one sequence with each token's own position (query_positions), or
    `by_runs`: a sequence for each run of consecutive tokens (the layout before)."""
    from loraplex.engine.blending import metadata_by_runs

    generator = torch.Generator().manual_seed(0)
    positions = torch.randperm(prompt_len, generator=generator)[:round(share * prompt_len)].sort().values
    kv_layer, tables = paged_cache([prompt_len])
    positions = positions.to(DEVICE)
    n = len(positions)
    q = randn(n, HEADS, HEAD_DIM)
    if by_runs:
        meta = metadata_by_runs(torch.zeros(n, dtype=torch.int64, device=DEVICE), tables, positions)
        tables, qsl, lens, query_positions = meta.block_tables, meta.query_start_loc, meta.seq_lens, None
    else:
        qsl = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
        lens = torch.tensor([int(positions[-1]) + 1], dtype=torch.int32, device=DEVICE)
        query_positions = positions.to(torch.int32)
    flops = 4.0 * HEADS * HEAD_DIM * float((positions + 1).sum())  # each token at p attends to p + 1 keys
    nbytes = kv_bytes([prompt_len]) + 2 * n * HEADS * HEAD_DIM * 2
    config = prefill_attention.prefill_config(HEADS // KV_HEADS, HEAD_DIM)
    run = lambda _: prefill_attention._launch(q, kv_layer, tables, qsl, lens, HEAD_DIM ** -0.5, True,
                                              config, query_positions)
    t = time_per_call(run, [None], min_calls=8)
    layout = f"{len(lens)} sequences (a run each)" if by_runs else "one sequence, query positions"
    return result("paged_attention", f"{n} of {prompt_len} tokens scattered, {layout}", t, nbytes, flops)


# ---------------------------------------------------------------- LoRA


@dataclass(frozen=True)
class LoraCase:
    name: str
    num_tokens: int
    num_adapters: int
    rank: int
    max_rank: int
    in_features: int
    slice_sizes: tuple[int, ...]


LORA_CASES = [
    LoraCase("qkv, 64 tokens x 64 adapters r16 (target)", 64, 64, 16, 16, HIDDEN,
             (HIDDEN, 1024, 1024)),
    LoraCase("qkv, 64 x 64 r16 in max_rank-64 slots", 64, 64, 16, 64, HIDDEN, (HIDDEN, 1024, 1024)),
    LoraCase("gate_up, 64 x 64 r16", 64, 64, 16, 16, HIDDEN, (INTERMEDIATE, INTERMEDIATE)),
    LoraCase("down, 64 x 64 r16", 64, 64, 16, 16, INTERMEDIATE, (HIDDEN,)),
    LoraCase("o, 64 x 64 r16", 64, 64, 16, 16, HIDDEN, (HIDDEN,)),
    LoraCase("qkv, 256 tokens x 8 adapters r16", 256, 8, 16, 16, HIDDEN, (HIDDEN, 1024, 1024)),
    LoraCase("qkv, prefill 2048 tokens x 4 adapters r16", 2048, 4, 16, 16, HIDDEN,
             (HIDDEN, 1024, 1024)),
]


def lora_inputs(case: LoraCase):
    num_slots, num_slices = case.num_adapters + 1, len(case.slice_sizes)
    out_features = sum(case.slice_sizes)
    offsets = [0]
    for size in case.slice_sizes:
        offsets.append(offsets[-1] + size)
    a = randn(num_slots, num_slices, case.max_rank, case.in_features, scale=0.02)
    b = randn(num_slots, out_features, case.max_rank, scale=0.02)
    ranks = torch.full((num_slots, num_slices), case.rank, dtype=torch.int32, device=DEVICE)
    ranks[0] = 0
    if case.num_tokens <= case.num_adapters:  # decode: a distinct adapter per token
        slots = torch.randperm(case.num_adapters, device=DEVICE)[:case.num_tokens] + 1
    else:  # runs of one adapter, as prefill chunks or shared adapters give
        slots = torch.arange(case.num_tokens, device=DEVICE) * case.num_adapters
        slots = slots // case.num_tokens + 1
    slots = slots.to(torch.int32)
    x = randn(case.num_tokens, case.in_features)
    y = randn(case.num_tokens, out_features)
    return x, a, b, slots, ranks, offsets, y


def lora_bytes(case: LoraCase, which: str = "both") -> tuple[float, float]:
    """(adapter bytes that must be read: the true rank of A (shrink) and/or B (expand) of each
    active adapter; all bytes: those plus x, y read and written, the shrunk buffer zeroed,
    written and read)."""
    active = min(case.num_tokens, case.num_adapters)
    out_features = sum(case.slice_sizes)
    a_bytes = active * case.rank * len(case.slice_sizes) * case.in_features * 2
    b_bytes = active * case.rank * out_features * 2
    shrunk = len(case.slice_sizes) * case.num_tokens * case.max_rank * 4
    x_io, y_io = case.num_tokens * case.in_features * 2, case.num_tokens * out_features * 2 * 2
    if which == "shrink":
        return a_bytes, a_bytes + x_io + 2 * shrunk
    if which == "expand":
        return b_bytes, b_bytes + y_io + shrunk
    return a_bytes + b_bytes, a_bytes + b_bytes + x_io + y_io + 3 * shrunk


def bench_lora(case: LoraCase, shrink_cfg=None, expand_cfg=None, which: str = "both",
               impl: ModuleType = lora) -> Result:
    """Times lora.py's launchers (or `impl`'s: another version of the module with the same
    launchers) with the given configs, else those the module picks."""
    adapter, total = lora_bytes(case, which)
    if ("lora", case) not in _INPUTS:
        _INPUTS.clear()
        # enough sets that the smaller op (shrink alone or expand alone) also misses L2
        smallest = min(lora_bytes(case, "shrink")[0], lora_bytes(case, "expand")[0])
        _INPUTS[("lora", case)] = [lora_inputs(case) for _ in range(num_sets(smallest))]
    sets = _INPUTS[("lora", case)]
    x0, a0 = sets[0][0], sets[0][1]
    shrink_cfg = shrink_cfg or impl.shrink_config(case.num_tokens, a0.shape[1], case.in_features,
                                                  case.max_rank, x0.device)
    expand_cfg = expand_cfg or impl.expand_config(case.num_tokens, case.max_rank)
    shrunk = {id(s): impl._launch_shrink(s[0], s[1], s[3], s[4], shrink_cfg) for s in sets}

    def run(s):
        x, a, b, slots, ranks, offsets, y = s
        if which in ("both", "shrink"):
            sh = impl._launch_shrink(x, a, slots, ranks, shrink_cfg)
        else:
            sh = shrunk[id(s)]
        if which in ("both", "expand"):
            impl._launch_expand(y, sh, b, slots, ranks, offsets, expand_cfg)

    t = time_per_call(run, sets)
    kernel = f"lora_{which}" if which != "both" else "lora_shrink+expand"
    if impl is not lora:
        kernel += f"@{impl.__name__}"
    res = result(kernel, case.name, t, adapter, total_bytes=total, shrink=asdict(shrink_cfg),
                 expand=asdict(expand_cfg))
    res.notes["all_bytes_gbps"] = total / t / 1e9
    return res


def load_module(path: Path) -> ModuleType:
    """A module from a file (another version of a kernels module, for comparison)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # triton's JIT looks its kernels' module up
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- sampling


def bench_sample(batch: int, temperature: float, top_k: int, top_p: float) -> Result:
    nbytes = batch * VOCAB * 4
    logits = torch.randn(batch, VOCAB, device=DEVICE) * 3
    full = lambda v, dt: torch.full((batch,), v, dtype=dt, device=DEVICE)
    args = (logits, full(temperature, torch.float32), full(top_k, torch.int32),
            full(top_p, torch.float32), torch.arange(batch, device=DEVICE),
            torch.zeros(batch, dtype=torch.int64, device=DEVICE))
    t = time_per_call(lambda _: sampling_mod.sample(*args), [None], min_calls=16)
    return result("sample", f"batch={batch} T={temperature} top_k={top_k} top_p={top_p}", t,
                  nbytes)


def bench_mask_logits(batch: int, num_masked: int) -> Result:
    """Structured outputs' token masks: the logits copied, `num_masked` rows masked."""
    words = -(-VOCAB // 32)
    nbytes = 2 * batch * VOCAB * 4 + num_masked * (words * 4 + VOCAB * 4)
    logits = torch.randn(batch, VOCAB, device=DEVICE)
    rows = torch.arange(0, 2 * num_masked, 2, device=DEVICE) % batch
    bitmask = torch.randint(-2**31, 2**31 - 1, (num_masked, words), dtype=torch.int32, device=DEVICE)
    t = time_per_call(lambda _: token_mask.mask_logits(logits, rows, bitmask), [None], min_calls=16)
    return result("mask_logits", f"batch={batch} masked={num_masked}", t, nbytes)


# ---------------------------------------------------------------- sweeps


Case = tuple[str, Callable[[], "Result | None"]]


def case(fn, *args, **kwargs) -> Case:
    """(a name to filter on, a thunk that runs fn and survives its failure)."""
    def describe(value) -> str:
        if isinstance(value, LoraCase):
            return value.name
        return value.__name__ if isinstance(value, ModuleType) else str(value)

    words = [describe(a) for a in args] + [f"{k}={describe(v)}" for k, v in kwargs.items()]
    return f"{fn.__name__}({', '.join(words)})", lambda: guarded(fn, *args, **kwargs)


def lora_cases(*prefixes: str) -> list[LoraCase]:
    return [next(c for c in LORA_CASES if c.name.startswith(p)) for p in prefixes]


LORA_SWEEP_CASES = lora_cases("qkv, 64 tokens", "gate_up", "down", "o,")


def sweep_cases() -> list[Case]:
    out = []
    for batch, context in ((64, 2048), (256, 1024), (8, 8192), (1, 8192)):
        for cfg in decode_attention.CANDIDATE_CONFIGS:
            programs = batch * KV_HEADS * cfg.num_splits
            if programs > 4096 or (batch < 64 and programs < 64):
                continue  # splits far from what this batch could use
            out.append(case(bench_decode, batch, context, cfg))
    for lora_case in LORA_SWEEP_CASES:
        out += [case(bench_lora, lora_case, shrink_cfg=cfg, which="shrink")
                for cfg in lora.CANDIDATE_SHRINK_CONFIGS]
        out += [case(bench_lora, lora_case, expand_cfg=cfg, which="expand")
                for cfg in lora.CANDIDATE_EXPAND_CONFIGS]
    out += [case(bench_lora, lora_cases("qkv, prefill")[0], shrink_cfg=s, expand_cfg=e)
            for s, e in lora.CANDIDATE_TILE_CONFIGS]
    out += [case(bench_prefill, [2048], [0], cfg) for cfg in prefill_attention.CANDIDATE_CONFIGS]
    return out


# ---------------------------------------------------------------- driver


def guarded(fn, *args, **kwargs) -> Result | None:
    try:
        return fn(*args, **kwargs)
    except Exception:  # one failing case must not lose the others' numbers
        print(f"FAILED {fn.__name__}{args}: {traceback.format_exc(limit=3)}", file=sys.stderr)
        return None


def main_cases(lora_baseline: ModuleType | None = None) -> list[Case]:
    def lora_case(*args, **kwargs) -> list[Case]:
        """The case, and the baseline implementation's right after it."""
        both = [case(bench_lora, *args, **kwargs)]
        if lora_baseline is not None:
            both.append(case(bench_lora, *args, **kwargs, impl=lora_baseline))
        return both

    return [
        case(bench_decode, 64, 2048), *lora_case(LORA_CASES[0]),
        case(bench_norm, 64), case(bench_norm, 4096),
        case(bench_silu, 64), case(bench_silu, 4096),
        case(bench_rotary, 64), case(bench_rotary, 4096),
        case(bench_decode, 256, 1024), case(bench_decode, 8, 8192), case(bench_decode, 1, 8192),
        case(bench_prefill, [2048], [0]), case(bench_prefill, [512, 512], [4096, 1024]),
        case(bench_scattered_prefill, 4096, 0.2), case(bench_scattered_prefill, 4096, 0.2, True),
        *[c for lc in LORA_CASES[1:] for c in lora_case(lc)],
        *lora_case(LORA_CASES[0], which="shrink"),
        *lora_case(LORA_CASES[0], which="expand"),
        case(bench_sample, 64, 0.0, 0, 1.0), case(bench_sample, 64, 1.0, 0, 1.0),
        case(bench_sample, 64, 0.8, 50, 0.9), case(bench_sample, 64, 1.0, 0, 0.95),
        case(bench_sample, 256, 0.8, 50, 0.9),
        case(bench_mask_logits, 64, 32),
    ]


def gpu_slug(name: str) -> str:
    found = re.search(r"(H100|H200|A100|L40S|B200|GH200)", name)
    return found.group(1).lower() if found else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def gpu_bench_meta(command: str, **extra: object) -> dict:
    """Start a kernel benchmark (`command`: its CLI name): exit without a CUDA GPU, seed, and
    return the machine's description for its JSON, with `extra`."""
    if not torch.cuda.is_available():
        sys.exit(f"loraplex bench {command} needs a CUDA GPU")
    torch.manual_seed(0)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "ceiling_bytes_per_s": ceiling_bytes_per_s(),
            "device_floors": measure("cuda", "bfloat16").as_dict(), **extra}


def print_table(title: str, results: list[Result]) -> None:
    print(f"\n{title}")
    ceiling = f"of {ceiling_bytes_per_s() / 1e12:.1f}TB/s"
    print(f"{'kernel':<32} {'case':<44} {'us':>9} {'GB/s':>8} {ceiling:>10} {'TFLOP/s':>8}")
    for r in results:
        tf = f"{r.tflops:8.1f}" if r.flops else " " * 8
        print(f"{r.kernel:<32} {r.case[:44]:<44} {r.time_us:9.2f} {r.gbps:8.0f} "
              f"{100 * r.fraction_of_ceiling:9.1f}% {tf}")


def targets(results: list[Result]) -> dict[str, dict]:
    def find(kernel: str, case: str) -> Result | None:
        return next((r for r in results if r.kernel == kernel and r.case.startswith(case)), None)

    decode = find("paged_decode_attention", "batch=64 context=2048")
    lora_r = find("lora_shrink+expand", "qkv, 64 tokens x 64 adapters r16")
    out = {}
    for name, r, goal in (("decode attention batch 64 ctx 2048 >= 70%", decode, 0.70),
                          ("LoRA shrink+expand qkv 64x64 r16 >= 60% (adapter bytes)", lora_r,
                           0.60)):
        frac = r.fraction_of_ceiling if r else float("nan")
        out[name] = {"fraction": frac, "pass": bool(r and frac >= goal)}
    return out


def run_and_record(cases: list[Case], path: Path, meta: dict) -> list[Result]:
    """Runs the cases in turn, rewriting the JSON after each, so a run cut short by a time
    limit still leaves every figure it got."""
    results: list[Result] = []
    for _, run in cases:
        r = run()
        if r is not None:
            results.append(r)
            print(f"  {r.kernel:<32} {r.case[:44]:<44} {r.time_us:9.2f} us {r.gbps:7.0f} GB/s "
                  f"{100 * r.fraction_of_ceiling:5.1f}% {r.notes}", flush=True)
        goals = targets(results)
        path.write_text(json.dumps({**meta, "targets": goals,
                                    "results": [asdict(x) for x in results]}, indent=1))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true",
                        help="time alternative launch configs instead of the main cases")
    parser.add_argument("--only", metavar="REGEX",
                        help="run only the cases whose names match (e.g. 'lora')")
    parser.add_argument("--lora-baseline", type=Path, metavar="FILE",
                        help="another version of kernels/lora.py, timed beside it")
    parser.add_argument("--tag", help="suffix of the JSON file's name")
    parser.add_argument("--paged", action="store_true",
                        help="compare adapters read through pages with slots, per family")
    parser.add_argument("--tiny", action="store_true", help="with --paged: a toy shape (as on the CPU)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.paged:
        from loraplex.benchmarks.paged_kernels import run

        run(args.out, args.tiny)
        return
    meta = gpu_bench_meta("kernels", ceiling_flops=ceiling_flops())
    name = meta["device"]
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = (f"-{args.tag}" if args.tag else "") + ("-sweep" if args.sweep else "")
    path = args.out / f"kernels-{gpu_slug(name)}{suffix}.json"
    baseline = load_module(args.lora_baseline) if args.lora_baseline else None
    cases = sweep_cases() if args.sweep else main_cases(baseline)
    if args.only:
        cases = [c for c in cases if re.search(args.only, c[0])]
    results = run_and_record(cases, path, meta)
    print_table(f"{name}: per call, CUDA-graph replay, inputs cycled past L2", results)
    if not args.sweep:
        for goal, verdict in targets(results).items():
            print(f"target {goal}: {100 * verdict['fraction']:.1f}% -> "
                  f"{'PASS' if verdict['pass'] else 'FAIL'}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""`loraplex bench relay`: tenants' shared system prompts in the engine, three ways in one run
on one engine (Llama-3-8B shape, random weights, bf16):

- relay: the prefix cache, the prompts pinned, and relay decode (the measured rule);
- cache: the prefix cache and the prompts pinned, plain paged decode (what vLLM does);
- none: no prefix cache: every request prefills and reads its whole prompt.

4 tenants, each with its own rank-16 adapter and an S-token system prompt (S = 2,048 and 4,096);
each request has 64 prompt tokens of its own and generates 192; batches 64, 128, 256. Decode
throughput (steps after every request has its first token) next to two floors, each the bytes a
step must read at the device's measured copy bandwidth or its FLOPs at the device's measured
matrix throughput, whichever binds (loraplex.benchmarks.device_floors): the unique floor
(weights, adapters, each shared prompt's KV once, each request's own KV) and the mode's nominal
floor (every request reads its whole context). Also the
time to first token of one request joining a warm (pinned) prompt against a cold one. Batches
whose KV does not fit without sharing are skipped for "none" (and say so)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from loraplex.benchmarks import synthetic
from loraplex.benchmarks.decode import LORA_MODULES
from loraplex.benchmarks.device_floors import measure
from loraplex.benchmarks.results import RESULTS, write
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.relay_groups import RelayRule
from loraplex.engine_config import EngineConfig
from loraplex.kernels import engine_ops
from loraplex.types import SamplingParams

NUM_TENANTS = 4
MODES = ("relay", "cache", "none")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=ints, default=(64, 128, 256))
    parser.add_argument("--system-lens", type=ints, default=(2048, 4096))
    parser.add_argument("--own-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=192)
    add_engine_options(parser)
    args = parser.parse_args(argv)
    result = run(args)
    print(f"wrote {write(result, args.out, 'relay')}")


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The options `make_engine` reads, and --out."""
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model-overrides", type=json.loads, default={},
                        help="JSON of config.json keys replacing the Llama-3-8B shape (CPU smoke runs)")
    parser.add_argument("--out", type=Path, default=RESULTS)


def make_engine(args: argparse.Namespace, max_len: int, max_num_seqs: int) -> tuple[LLMEngine, Any]:
    """The benchmarks' engine (Llama-3-8B shape unless overridden, random weights, relay "auto")
    with NUM_TENANTS rank-`args.rank` adapters a0, a1, ...; and the model's config."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    config = synthetic.model_config(args.model_overrides)
    model = synthetic.random_model(config, engine_ops(device), dtype, device, max_len,
                                   scaled_residual=True)
    engine = LLMEngine(EngineConfig.from_kwargs(
        "synthetic-llama-3-8b", device=device.type, dtype=args.dtype, max_model_len=max_len,
        block_size=16, max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
        max_lora_rank=args.rank, max_loras=NUM_TENANTS, relay_attention="auto"), model=model)
    for t in range(NUM_TENANTS):
        engine.add_adapter(f"a{t}", synthetic.random_adapter(config, args.rank, dtype, device, f"a{t}",
                                                             seed=t + 1, pin=device.type == "cuda"))
    return engine, config


def run(args: argparse.Namespace) -> dict[str, Any]:
    max_len = max(args.system_lens) + args.own_len + args.new_tokens + 16
    floors = measure(args.device, args.dtype)  # before the model and KV cache take the memory
    engine, config = make_engine(args, max_len, max(args.batches))
    device = engine.device
    rows, joins = [], []
    for system_len in args.system_lens:
        systems = [random_tokens(config.vocab_size, system_len, seed=100 * system_len + t)
                   for t in range(NUM_TENANTS)]
        for batch in args.batches:
            for mode in MODES:
                row = _run_mode(engine, args, config, systems, batch, mode)
                rows.append(row)
                print(json.dumps(row), flush=True)
        joins.append(_join_warm(engine, args, config, system_len))
        print(json.dumps(joins[-1]), flush=True)
    return {"device": device_name(device), "torch": torch.__version__, "model": "llama-3-8b shape",
            "dtype": args.dtype, "tenants": NUM_TENANTS, "rank": args.rank, "own_len": args.own_len,
            "new_tokens": args.new_tokens, "device_floors": floors.as_dict(),
            "num_kv_blocks": engine.memory.num_kv_blocks, "rows": rows, "join_warm": joins,
            "speedups": _speedups(rows)}


def set_mode(engine: LLMEngine, mode: str) -> None:
    """Prefix cache and relay decode for `mode` (of MODES), starting from a cold cache."""
    engine.blocks.reset_prefix_cache()
    engine.blocks.enable_prefix_caching = mode != "none"
    engine.runner.inputs.relay = RelayRule("auto" if mode == "relay" else "off")


def _run_mode(engine: LLMEngine, args, config, systems: list[list[int]], batch: int, mode: str
              ) -> dict[str, Any]:
    set_mode(engine, mode)
    system_len = len(systems[0])
    row: dict[str, Any] = {"mode": mode, "batch": batch, "system_len": system_len}
    context = system_len + args.own_len + args.new_tokens
    blocks_needed = batch * -(-context // 16) if mode == "none" else (
        NUM_TENANTS * system_len // 16 + batch * -(-(args.own_len + args.new_tokens) // 16 + 1))
    capacity = engine.memory.num_kv_blocks
    if blocks_needed > capacity:
        return row | {"skipped": f"needs {blocks_needed} KV blocks, the cache has {capacity}"}
    keys = []
    if mode != "none":
        for t, system in enumerate(systems):
            keys.append(f"bench-{t}-{system_len}")
            engine.pin_prompt(keys[-1], system, tenant=f"t{t}", adapter=f"a{t}")
        _drain(engine)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        t = i % NUM_TENANTS
        own = random_tokens(config.vocab_size, args.own_len, seed=i + 7 * batch)
        engine.add_request(f"{mode}-{system_len}-{batch}-{i}", prompt_token_ids=systems[t] + own,
                           params=params, adapter=f"a{t}", tenant=f"t{t}")
    started = time.perf_counter()
    seen: set[str] = set()
    decode_start, relay_steps = None, engine.runner.inputs.num_relay_steps
    engine.blocks.peak_used_blocks = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        seen.update(o.request_id for o in outputs)
        if decode_start is None and len(seen) == batch:
            sync(engine.device)
            decode_start = time.perf_counter()
    sync(engine.device)
    ended = time.perf_counter()
    for key in keys:
        engine.unpin_prompt(key)
    step_s = (ended - decode_start) / (args.new_tokens - 1)
    unique, nominal = _floor_bytes(engine, config, args, batch, system_len)
    floors, flops = measure(args.device, args.dtype), _step_flops(config, args, batch, system_len)
    unique_floor, nominal_floor = floors.floor(unique, flops), floors.floor(nominal, flops)
    floor_s, nominal_s = unique_floor["floor_s"], nominal_floor["floor_s"]
    return row | {
        "step_ms": round(step_s * 1e3, 3), "decode_tok_s": round(batch / step_s, 1),
        "unique_floor_ms": round(floor_s * 1e3, 3), "nominal_floor_ms": round(nominal_s * 1e3, 3),
        "unique_floor_binding": unique_floor["binding"],
        "flops_floor_ms": round(unique_floor["flops_floor_s"] * 1e3, 3),
        "step_over_unique_floor": round(step_s / floor_s, 3),
        "step_over_nominal_floor": round(step_s / nominal_s, 3),
        "prefill_s": round(decode_start - started, 3), "peak_kv_blocks": engine.blocks.peak_used_blocks,
        "e2e_tok_s": round(batch * args.new_tokens / (ended - started), 1),
        "relay_steps": engine.runner.inputs.num_relay_steps - relay_steps,
    }


def _join_warm(engine: LLMEngine, args, config, system_len: int) -> dict[str, Any]:
    """Time to first token of one request on a pinned (warm) prompt against a cold one."""
    set_mode(engine, "relay")
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    own = random_tokens(config.vocab_size, args.own_len, seed=1)
    cold_system = random_tokens(config.vocab_size, system_len, seed=999)
    times = {}
    for label, system in (("cold", cold_system), ("warm", cold_system)):
        started = time.perf_counter()
        engine.add_request(f"join-{label}-{system_len}", prompt_token_ids=system + own, params=params,
                           adapter="a0", tenant="t0")
        _drain(engine)
        times[label] = time.perf_counter() - started
        if label == "cold":
            engine.pin_prompt(f"join-{system_len}", system, tenant="t0", adapter="a0")
            _drain(engine)
    engine.unpin_prompt(f"join-{system_len}")
    return {"system_len": system_len, "cold_ttft_ms": round(times["cold"] * 1e3, 2),
            "warm_ttft_ms": round(times["warm"] * 1e3, 2),
            "warm_over_cold": round(times["warm"] / times["cold"], 3)}


def _floor_bytes(engine: LLMEngine, config, args, batch: int, system_len: int) -> tuple[float, float]:
    """(unique, nominal) bytes of one decode step at the mean own context."""
    element = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    weights = sum(p.numel() * p.element_size() for n, p in engine.model.named_parameters()
                  if n != "embed_tokens")
    per_token = config.num_layers * 2 * config.kv_size * element
    per_rank = config.num_layers * sum(sum(config.shape.features(m)) for m in LORA_MODULES) * element
    adapters = NUM_TENANTS * args.rank * per_rank
    own = args.own_len + args.new_tokens / 2
    unique = weights + adapters + (NUM_TENANTS * system_len + batch * own) * per_token
    nominal = weights + adapters + batch * (system_len + own) * per_token
    return unique, nominal


def _step_flops(config, args, batch: int, system_len: int) -> float:
    """FLOPs of one decode step at the mean own context: every row through the weights and its
    tenant's adapter, and its attention over the shared prompt and its own tokens (the same
    whether the prompt's KV is read once or per request)."""
    layer = (config.hidden_size * (config.q_size + 2 * config.kv_size) + config.q_size * config.hidden_size
             + 3 * config.hidden_size * config.intermediate_size)
    weights = 2 * batch * (config.num_layers * layer + config.vocab_size * config.hidden_size)
    context = system_len + args.own_len + args.new_tokens / 2
    attention = 4 * batch * context * config.num_layers * config.q_size
    per_rank = config.num_layers * sum(sum(config.shape.features(m)) for m in LORA_MODULES)
    return weights + attention + 2 * batch * args.rank * per_rank


def _speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(r["system_len"], r["batch"], r["mode"]): r for r in rows if "step_ms" in r}
    out = []
    for (system_len, batch, mode), row in by.items():
        if mode != "relay":
            continue
        entry = {"system_len": system_len, "batch": batch}
        for other in ("cache", "none"):
            if (system_len, batch, other) in by:
                other_ms = by[system_len, batch, other]["step_ms"]
                entry[f"relay_over_{other}"] = round(other_ms / row["step_ms"], 3)
        out.append(entry)
    return out


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def random_tokens(vocab: int, n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n,), generator=generator).tolist()


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    main()

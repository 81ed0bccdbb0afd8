"""`loraplex bench relay-offline`: an offline batch whose shared prefixes nobody registered
(issue 12's offline variant; BatchLLM's setting), on the engine of `loraplex bench relay`
(Llama-3-8B shape, random weights, bf16, 4 tenants each with its own rank-16 adapter).

1,024 prompts in 16 groups; a group's prompts start with the same 1,024 tokens (its tenant's
adapter, tenant g % 4), then 64 tokens of their own; 128 tokens generated each; the batch in a
shuffled order. Run to the end four ways, each from a cold prefix cache:

- grouped: global prefix grouping (a prefix tree over the batch: each prefix computed once,
  its group scheduled together), the prefix cache, relay decode (the measured rule);
- cache: the prefix cache and relay decode, prompts in the batch's order;
- cache-plain: the prefix cache, plain paged decode, in order (what vLLM does);
- none: no prefix sharing.

Per way: output tokens/s end to end, peak KV blocks held, prompt tokens computed (the rest came
from the cache), steps that ran relay decode."""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import torch

from loraplex.benchmarks.relay import (
    NUM_TENANTS,
    add_engine_options,
    device_name,
    make_engine,
    random_tokens,
    sync,
)
from loraplex.benchmarks.results import write
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.offline_batch import BatchRequest, run_batch
from loraplex.engine.relay_groups import RelayRule
from loraplex.types import SamplingParams

WAYS = {  # way -> (global grouping, prefix cache, relay)
    "grouped": (True, True, "auto"), "cache": (False, True, "auto"),
    "cache-plain": (False, True, "off"), "none": (False, False, "off"),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=1024)
    parser.add_argument("--num-groups", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--own-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--ways", type=lambda text: text.split(","), default=list(WAYS))
    add_engine_options(parser)
    args = parser.parse_args(argv)
    unknown = set(args.ways) - set(WAYS)
    if unknown:
        parser.error(f"unknown ways {sorted(unknown)}; choose from {list(WAYS)}")
    result = run(args)
    print(f"wrote {write(result, args.out, 'relay-offline')}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine, config = make_engine(args, args.prefix_len + args.own_len + args.new_tokens + 16,
                                 args.max_num_seqs)
    requests = batch(args, config.vocab_size)
    _run_way(engine, requests, "cache", tag="warm-up")  # adapter loads, first compiles, allocator
    rows = []
    for way in args.ways:
        rows.append(_run_way(engine, requests, way))
        print(json.dumps(rows[-1]), flush=True)
    by_way = {row["way"]: row for row in rows}
    ratios = {f"grouped_over_{way}": {
        "throughput": round(by_way["grouped"]["output_tok_s"] / by_way[way]["output_tok_s"], 3),
        "peak_kv_blocks": round(by_way["grouped"]["peak_kv_blocks"] / by_way[way]["peak_kv_blocks"], 3),
    } for way in by_way if way != "grouped" and "grouped" in by_way}
    return {"device": device_name(engine.device), "torch": torch.__version__,
            "model": "llama-3-8b shape" if not args.model_overrides else args.model_overrides,
            "dtype": args.dtype, "tenants": NUM_TENANTS, "rank": args.rank,
            "num_prompts": args.num_prompts, "num_groups": args.num_groups, "prefix_len": args.prefix_len,
            "own_len": args.own_len, "new_tokens": args.new_tokens, "max_num_seqs": args.max_num_seqs,
            "num_kv_blocks": engine.memory.num_kv_blocks, "rows": rows, "ratios": ratios}


def batch(args: argparse.Namespace, vocab: int) -> list[BatchRequest]:
    """The workload, shuffled: prompt i belongs to group i % num_groups."""
    prefixes = [random_tokens(vocab, args.prefix_len, seed=5000 + g) for g in range(args.num_groups)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    requests = []
    for i in range(args.num_prompts):
        group = i % args.num_groups
        tenant = group % NUM_TENANTS
        requests.append(BatchRequest(
            request_id=f"p{i}", token_ids=prefixes[group] + random_tokens(vocab, args.own_len, seed=i),
            params=params, adapter=f"a{tenant}", tenant=f"t{tenant}"))
    random.Random(0).shuffle(requests)
    return requests


def _run_way(engine: LLMEngine, requests: list[BatchRequest], way: str, tag: str = "") -> dict[str, Any]:
    grouped, prefix_cache, relay = WAYS[way]
    blocks = engine.blocks
    blocks.reset_prefix_cache()
    blocks.enable_prefix_caching = prefix_cache
    engine.runner.inputs.relay = RelayRule(relay)
    hits, relay_steps = blocks.num_hit_tokens, engine.runner.inputs.num_relay_steps
    blocks.peak_used_blocks = 0
    runs = [BatchRequest(f"{tag or way}-{r.request_id}", r.token_ids, r.params, r.adapter, r.tenant)
            for r in requests]
    sync(engine.device)
    started = time.perf_counter()
    outputs = run_batch(engine, runs, group_prefixes=grouped)
    sync(engine.device)
    seconds = time.perf_counter() - started
    num_out = sum(len(o.token_ids) for o in outputs)
    num_prompt = sum(len(r.token_ids) for r in requests)
    return {"way": way, "seconds": round(seconds, 3), "output_tok_s": round(num_out / seconds, 1),
            "peak_kv_blocks": blocks.peak_used_blocks, "prompt_tokens": num_prompt,
            "prompt_tokens_computed": num_prompt - (blocks.num_hit_tokens - hits),
            "relay_steps": engine.runner.inputs.num_relay_steps - relay_steps}


if __name__ == "__main__":
    main()

"""What do decode steps and steps computing a prompt beside decodes cost when every decoding
request has its own adapter, against all on one? (issue 27: in the H200 serving pass's step log,
steps with 1-1,024 prompt tokens took 18-20 ms at p50 in the 1,000-adapter Poisson runs against
8-10 ms with one adapter, while decode-only steps took 11.6 against 8.2 ms.)

The serving pass's engine (synthetic_server's: Llama-3-8B shape, bf16, 128 running places, 8,192
tokens a step, mixed-step graphs on), its rank-16 adapters on all seven projections. DECODERS
requests decode (prompts of 256 tokens) with adapters 0..DISTINCT-1 in turn; then, ten times
over, one new request of P prompt tokens (its own adapter, resident) is added and the engine
stepped to its first token. Prints a JSON line a case (decode step, mixed step, graph replays
of mixed steps) and writes them to --out.

    python studies/mixed_adapters_cost.py [--decoders 112] [--out studies/results/X.json]"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from loraplex.benchmarks import synthetic_server as server
from loraplex.benchmarks.serve_workload import FIRST_TOKEN
from loraplex.types import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decoders", type=int, default=112)
    parser.add_argument("--prompts", default="64,256,768")
    parser.add_argument("--out", type=Path, default=Path("studies/results/mixed-adapters-cost.json"))
    parser.add_argument("server_args", nargs="*", help="synthetic_server options (--device cpu ...)")
    args = parser.parse_args()
    options = server.parse_args(["--setup", "unused.json", *args.server_args])
    engine = server.build_engine(options)
    server.prepare_engine(engine, options)
    device = engine.device
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    graphs = engine.runner.graphs

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run_until_first(request_ids: set[str]) -> int:
        steps, seen = 0, set()
        while not request_ids <= seen:
            seen.update(o.request_id for o in engine.step())
            steps += 1
        return steps

    rows = []
    for distinct in (1, args.decoders):
        digests = [server.synthetic_digest(j) for j in range(args.decoders + 1)]
        params = SamplingParams(max_tokens=4000, ignore_eos=True, temperature=0.0)
        ids = {f"d{distinct}-{i}" for i in range(args.decoders)}
        for i, request_id in enumerate(sorted(ids)):
            engine.add_request(request_id, prompt_token_ids=rng.integers(FIRST_TOKEN, vocab, 256).tolist(),
                               params=params, adapter=digests[i % distinct], tenant=f"t{i % 40}")
        run_until_first(ids)
        for _ in range(5):
            engine.step()
        sync()
        begin = time.perf_counter()
        for _ in range(30):
            engine.step()
        sync()
        row = {"decoders": args.decoders, "distinct_adapters": distinct,
               "decode_step_ms": round((time.perf_counter() - begin) / 30 * 1e3, 3)}
        for prompt_len in map(int, args.prompts.split(",")):
            took, steps, replays = [], [], graphs.num_mixed_replays if graphs is not None else 0
            for k in range(11):
                new = f"p{distinct}-{prompt_len}-{k}"
                adapter = digests[args.decoders] if distinct > 1 else digests[0]
                sync()
                begin = time.perf_counter()
                prompt = rng.integers(FIRST_TOKEN, vocab, prompt_len).tolist()
                engine.add_request(new, prompt_token_ids=prompt, params=SamplingParams(max_tokens=1),
                                   adapter=adapter, tenant="t0")
                n = run_until_first({new})
                sync()
                if k:  # the first loads the new request's adapter
                    took.append(time.perf_counter() - begin)
                    steps.append(n)
            row[f"prompt_{prompt_len}"] = {
                "steps_to_first_token": float(np.mean(steps)),
                "to_first_token_ms": round(float(np.median(took)) * 1e3, 2),
                "mixed_replays": (graphs.num_mixed_replays - replays) if graphs is not None else None}
        for request_id in ids:
            engine.abort(request_id)
        while engine.has_unfinished_requests():
            engine.step()
        rows.append(row)
        print(json.dumps(row), flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": name, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

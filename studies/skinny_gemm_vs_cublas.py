"""Skinny GEMM (kernels/skinny_gemm.py) against cuBLAS at decode batch sizes (GPU only).

    python studies/skinny_gemm_vs_cublas.py [--out studies/results] [--shapes qkv,o] [--m 1,8] [--no-sweep]

For each Llama-3-8B projection (qkv, o, gate_up, down, lm_head; bf16 weight [N, K]) and each
M in 1, 2, 4, 8, 16, 32, times y = x @ w.T by
  (a) F.linear(x, w): cuBLAS on nn.Linear's layout,
  (b) x @ w_t with a pre-transposed contiguous weight [K, N]: cuBLAS's other layout,
  (c) skinny_linear with default_config,
  (d) skinny_linear with every config of candidate_configs (unless --no-sweep).
Timing, bandwidth and ceiling come from loraplex.benchmarks.kernel_speed (time_per_call: CUDA-graph replays of
many calls cycling over enough weight copies that the weights miss the 50 MB L2). Bytes that
must move = weight + x + y. Each timed output is checked against an fp32 reference (relative
error under 1e-2, else the figure is marked wrong and never wins). Prints a line per timing
and a summary table per (shape, M), and writes <out>/skinny-gemm-<gpu>.json with every figure
and the best config per (shape, M), rewritten after each (shape, M).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from loraplex.benchmarks import kernel_speed as bk
from loraplex.kernels import skinny_gemm

STUDY_RESULTS = Path("studies/results")
"""Where the studies' results go (run them from the repository root)."""

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
M_VALUES = (1, 2, 4, 8, 16, 32)
MAX_REL_ERROR = 1e-2
CUBLAS, CUBLAS_T, DEFAULT, CANDIDATE = "F.linear", "x @ w_t", "skinny default", "skinny"


def time_impl(impl: str, fn, sets: list, expected: torch.Tensor, label: str, nbytes: float,
              **notes) -> bk.Result | None:
    """Time fn over sets; None (and a message) if it fails. The first set's output is checked
    against expected."""
    try:
        out = fn(sets[0])
        err = ((out.float() - expected).norm() / expected.norm()).item()
        seconds = bk.time_per_call(fn, sets)
    except Exception as e:  # one failing config must not lose the others' figures
        print(f"  FAILED {impl} {label} {notes}: {type(e).__name__}: {str(e)[:300]}",
              file=sys.stderr, flush=True)
        return None
    res = bk.result(impl, label, seconds, nbytes, rel_error=err, ok=bool(err < MAX_REL_ERROR),
                    **notes)
    flag = "" if res.notes["ok"] else "  WRONG"
    print(f"  {impl:<15} {label:<16} {res.time_us:8.2f} us {res.gbps:6.0f} GB/s "
          f"{100 * res.fraction_of_ceiling:5.1f}%  {notes.get('config', '')}{flag}", flush=True)
    return res


def bench_shape_m(shape: str, m: int, weights: list, weights_t: list, sweep: bool
                  ) -> list[bk.Result]:
    n, k = SHAPES[shape]
    sets = [(bk.randn(m, k), w, wt) for w, wt in zip(weights, weights_t)]
    expected = F.linear(sets[0][0].float(), weights[0].float())
    label = f"{shape} M={m}"
    nbytes = (n * k + m * k + m * n) * 2
    common = dict(shape=shape, m=m, n=n, k=k)
    results = [time_impl(CUBLAS, lambda s: F.linear(s[0], s[1]), sets, expected, label, nbytes,
                         **common),
               time_impl(CUBLAS_T, lambda s: s[0] @ s[2], sets, expected, label, nbytes,
                         **common)]
    configs = [(DEFAULT, skinny_gemm.default_config(m, n, k, weights[0].device))]
    if sweep:
        configs += [(CANDIDATE, c) for c in skinny_gemm.candidate_configs(m, n, k)]
    for impl, config in configs:
        run = lambda s, c=config: skinny_gemm.skinny_linear(s[0], s[1], None, c)
        results.append(time_impl(impl, run, sets, expected, label, nbytes, config=asdict(config),
                                 **common))
    return [r for r in results if r is not None]


def summarize(shape: str, m: int, results: list[bk.Result]) -> dict:
    """The figures of one (shape, M): each implementation's, the winner, the best config."""
    ok = [r for r in results if r.notes["ok"]]
    first = lambda impl: next((r for r in ok if r.kernel == impl), None)
    skinny = [r for r in ok if r.kernel in (DEFAULT, CANDIDATE)]
    best = min(skinny, key=lambda r: r.time_us, default=None)
    cublas = [r for r in ok if r.kernel in (CUBLAS, CUBLAS_T)]
    winner = min(ok, key=lambda r: r.time_us, default=None)
    figure = lambda r: None if r is None else {
        "time_us": r.time_us, "gbps": r.gbps, "fraction_of_ceiling": r.fraction_of_ceiling}
    return {
        "shape": shape, "m": m, "n": SHAPES[shape][0], "k": SHAPES[shape][1],
        CUBLAS: figure(first(CUBLAS)), CUBLAS_T: figure(first(CUBLAS_T)),
        DEFAULT: figure(first(DEFAULT)),
        "default_config": first(DEFAULT).notes["config"] if first(DEFAULT) else None,
        "best_skinny": figure(best), "best_config": best.notes["config"] if best else None,
        "winner": None if winner is None else (
            "skinny" if winner.kernel in (DEFAULT, CANDIDATE) else winner.kernel),
        # the faster cuBLAS layout's time over the best skinny config's
        "speedup_vs_cublas": None if best is None or not cublas else
        min(r.time_us for r in cublas) / best.time_us,
    }


def print_summary(title: str, rows: list[dict]) -> None:
    def cell(fig):
        return f"{'-':>17}" if fig is None else \
            f"{fig['time_us']:8.2f} {100 * fig['fraction_of_ceiling']:6.1f}% "

    print(f"\n{title}\nus per call and fraction of {bk.ceiling_bytes_per_s() / 1e12:.1f} TB/s "
          "(weight + x + y bytes); speedup = faster cuBLAS time / best skinny time")
    print(f"{'shape':<8} {'M':>3} {CUBLAS:>17} {CUBLAS_T:>17} {DEFAULT:>17} "
          f"{'best skinny':>17} {'speedup':>7}  {'winner':<9} best config")
    for row in rows:
        cfg = row["best_config"]
        cfg_text = "" if cfg is None else \
            (f"n{cfg['block_n']} k{cfg['block_k']} split{cfg['split_k']} w{cfg['num_warps']} "
             f"s{cfg['num_stages']} {'dot' if cfg['use_dot'] else 'fma'}")
        speedup = "-" if row["speedup_vs_cublas"] is None else f"{row['speedup_vs_cublas']:.2f}x"
        print(f"{row['shape']:<8} {row['m']:>3} {cell(row[CUBLAS])} {cell(row[CUBLAS_T])} "
              f"{cell(row[DEFAULT])} {cell(row['best_skinny'])} {speedup:>7}  "
              f"{str(row['winner']):<9} {cfg_text}")


def parse_list(text: str, allowed) -> list:
    items = [type(next(iter(allowed)))(t) for t in text.split(",") if t]
    unknown = [t for t in items if t not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {list(allowed)}")
    return items


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=STUDY_RESULTS)
    parser.add_argument("--shapes", type=lambda t: parse_list(t, SHAPES), default=list(SHAPES),
                        help=f"comma-separated, of {','.join(SHAPES)}")
    parser.add_argument("--m", type=lambda t: parse_list(t, M_VALUES), default=list(M_VALUES),
                        help=f"comma-separated rows (tokens), of {','.join(map(str, M_VALUES))}")
    parser.add_argument("--no-sweep", dest="sweep", action="store_false",
                        help="time only the default config, not every candidate")
    args = parser.parse_args(argv)
    meta = bk.gpu_bench_meta("skinny-gemm", l2_defeat_bytes=bk.L2_DEFEAT_BYTES)
    name = meta["device"]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"skinny-gemm-{bk.gpu_slug(name)}.json"
    results, rows = [], []
    for shape in args.shapes:
        n, k = SHAPES[shape]
        weights = [bk.randn(n, k, scale=0.02) for _ in range(bk.num_sets(n * k * 2))]
        weights_t = [w.t().contiguous() for w in weights]
        print(f"{shape}: weight [{n}, {k}] bf16, {len(weights)} copies cycled", flush=True)
        for m in args.m:
            found = bench_shape_m(shape, m, weights, weights_t, args.sweep)
            results += found
            rows.append(summarize(shape, m, found))
            path.write_text(json.dumps({**meta, "summary": rows,
                                        "results": [asdict(r) for r in results]}, indent=1))
        del weights, weights_t
        torch.cuda.empty_cache()
    print_summary(f"{name}: per call, CUDA-graph replay, weights cycled past L2", rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

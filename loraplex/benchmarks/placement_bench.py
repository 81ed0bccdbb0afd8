"""Placement of prefill and decode (loraplex/engine/placement.py, DistServe's): for a workload and
its TTFT and TPOT targets, each placement's goodput on the machine's GPUs from the step-time
model's simulation, and the choice (CPU, seconds; no GPU needed).

    loraplex bench placement                       (the three standard workloads, two GPUs)
    loraplex bench placement --prompt-len 2048 --output-len 256 --slo-ttft 1 --slo-tpot 0.05"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from loraplex.benchmarks.results import RESULTS, write
from loraplex.engine.placement import DURATION_S, LONG_PROMPTS, StepModel, Targets, Workload, choose

STANDARD = (
    (LONG_PROMPTS, Targets(ttft_s=1.0, tpot_s=0.05)),
    (Workload("long prompts, tight TPOT (20 ms)", 2048, 256, num_adapters=1000),
     Targets(ttft_s=1.0, tpot_s=0.02)),
    (Workload("chat (512 in, 256 out, 1,000 adapters)", 512, 256, num_adapters=1000),
     Targets(ttft_s=1.0, tpot_s=0.05)),
)
"""Three workloads for the README: the issue's, the same with a tight TPOT target, and chat."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="loraplex bench placement",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, help="median prompt tokens (log-normal); without it, "
                        "the three standard workloads")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-adapters", type=int, default=1000)
    parser.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.05, help="seconds")
    parser.add_argument("--attainment", type=float, default=0.9)
    parser.add_argument("--duration-s", type=float, default=DURATION_S,
                        help="seconds of arrivals a simulation runs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    cases = STANDARD
    if args.prompt_len is not None:
        cases = ((Workload(f"{args.prompt_len} in, {args.output_len} out", args.prompt_len, args.output_len,
                           num_adapters=args.num_adapters),
                  Targets(args.slo_ttft, args.slo_tpot, args.attainment)),)
    model, rows = StepModel(), []
    for workload, targets in cases:
        choice = choose(workload, targets, args.gpus, model, args.duration_s)
        print(choice.reason)
        rows.append({"workload": asdict(workload), "targets": asdict(targets),
                     "choice": choice.placement.name, "goodput_req_per_s": choice.goodput,
                     "reason": choice.reason})
    path = write({"benchmark": "placement", "device": "simulated-h100", "gpus": args.gpus,
                  "step_model": asdict(model), "cases": rows}, args.out, "placement")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""`loraplex serve --disaggregate 1:1|auto [--slo-ttft S] [--slo-tpot S]`: prefill on one device
and decode on another (loraplex/engine/disaggregated.py, docs/disaggregated.md), always in the
engine-core process. The flags are checked before anything loads; `auto` runs the placement
(loraplex/engine/placement.py) and logs its choice, with each candidate's goodput."""

from __future__ import annotations

import argparse
import logging
import re
from typing import TYPE_CHECKING

from loraplex.engine_config import EngineConfig
from loraplex.errors import LoraplexError

if TYPE_CHECKING:
    from loraplex.engine.disaggregated import DisaggregatedEngine

BUILT = "1:1"
"""The one P:D built: one prefill and one decode device."""
AUTO = "auto"
DEFAULT_TTFT_S = 1.0
DEFAULT_TPOT_S = 0.05
"""Issue 23's targets, `auto`'s where --slo-ttft or --slo-tpot is not given."""
PLACEMENT_GPUS = 2
"""`auto` chooses between colocated and 1:1 on two GPUs: the placements that are built."""

logger = logging.getLogger("loraplex.serve")


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--disaggregate", metavar="P:D|auto",
                        help="prefill on one device and decode on another, each request's KV sent "
                        "between them (1:1 is built: on CUDA GPU 0 prefills and GPU 1 decodes; on CPU "
                        "two worker processes stand in); runs the engine in a process of its own. "
                        "auto: choose colocated or 1:1 with the placement of `loraplex bench "
                        "placement` for two GPUs, simulated with its H100 step model on issue 23's "
                        "workload (2K-token long-tailed prompts, 256 generated, 1,000 adapters) "
                        "and the targets below; the choice and each candidate's goodput are "
                        "logged. See docs/disaggregated.md")
    parser.add_argument("--slo-ttft", type=float, metavar="S",
                        help="with --disaggregate auto: the time-to-first-token target, seconds "
                        f"(default {DEFAULT_TTFT_S:g})")
    parser.add_argument("--slo-tpot", type=float, metavar="S",
                        help="with --disaggregate auto: the time-per-output-token target, seconds "
                        f"(default {DEFAULT_TPOT_S:g})")


def checked_disaggregation(args: argparse.Namespace, config: EngineConfig) -> str | None:
    """`--disaggregate` as asked ("1:1" or "auto"; None: not asked), refused with a
    LoraplexError naming the flag where it cannot be served with the other flags or devices."""
    asked = args.disaggregate
    for name, value in (("--slo-ttft", args.slo_ttft), ("--slo-tpot", args.slo_tpot)):
        if value is not None and asked != AUTO:
            raise LoraplexError(f"{name} is the target that --disaggregate auto places for: give "
                                "--disaggregate auto with it")
        if value is not None and not value > 0:
            raise LoraplexError(f"{name} {value:g}: a target is a positive number of seconds")
    if asked is None:
        return None
    if asked != AUTO:
        if re.fullmatch(r"[1-9]\d*:[1-9]\d*", asked) is None:
            raise LoraplexError(f"--disaggregate {asked!r}: give P:D, the prefill and decode devices "
                                f"(e.g. {BUILT}), or {AUTO}")
        if asked != BUILT:
            raise LoraplexError(f"--disaggregate {asked}: only {BUILT} (one prefill and one decode "
                                "device) is built")
    if config.tensor_parallel_size > 1:
        raise LoraplexError("--disaggregate runs each side on one device: it cannot be combined with "
                            f"--tensor-parallel-size {config.tensor_parallel_size}")
    if args.engine_process is False:
        raise LoraplexError("--disaggregate runs the engine in a process of its own: it cannot be "
                            "combined with --no-engine-process")
    num_gpus = _num_gpus(config.device)
    if num_gpus is not None and num_gpus < 2:
        raise LoraplexError(f"--disaggregate needs two GPUs, one a side; this machine has {num_gpus} "
                            "(--device cpu runs both sides on the CPU)")
    return asked


def placed(asked: str, args: argparse.Namespace) -> str | None:
    """What to serve for `asked` (checked): "1:1", or None for a colocated engine; `auto`'s
    choice is logged with why."""
    from loraplex.engine.placement import LONG_PROMPTS, Targets, choose

    if asked != AUTO:
        return asked
    targets = Targets(ttft_s=args.slo_ttft if args.slo_ttft is not None else DEFAULT_TTFT_S,
                      tpot_s=args.slo_tpot if args.slo_tpot is not None else DEFAULT_TPOT_S)
    logger.info("--disaggregate auto: placing for %d GPUs with the simulated H100 step model and issue 23's "
                "workload (`loraplex bench placement`)", PLACEMENT_GPUS)
    choice = choose(LONG_PROMPTS, targets, PLACEMENT_GPUS)
    if choice.placement.num_prefill == 0:
        logger.info("--disaggregate auto chose colocated: serving one colocated engine (its goodput "
                    "above is for one engine a GPU: a server a GPU behind a router)")
        return None
    logger.info("--disaggregate auto chose %s: serving prefill and decode on separate devices",
                choice.placement.name)
    return choice.placement.name


def build_disaggregated(config: EngineConfig) -> DisaggregatedEngine:
    """The engine-core process's engine for --disaggregate 1:1: each side's model in a worker
    process of its own, the prefill side stepping on a thread of its own."""
    from loraplex.engine.disaggregated import DisaggregatedEngine

    return DisaggregatedEngine(config, processes=True, concurrent=True)


def _num_gpus(device: str) -> int | None:
    """The CUDA devices the sides would run on (None: on the CPU)."""
    import torch

    if device == "cpu" or device == "auto" and not torch.cuda.is_available():
        return None
    return torch.cuda.device_count()

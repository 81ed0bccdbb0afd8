"""`python -m loraplex.benchmarks.plot results.json...`: the plot of each results file, by the
benchmark that wrote it (where the GPU machine had no matplotlib)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from loraplex.benchmarks import decode, fairness

PLOTS = {"fairness": fairness.plot}
"""Benchmark name -> its plot; decode's for the others (decode, decode-families)."""

if __name__ == "__main__":
    for name in sys.argv[1:]:
        path = Path(name)
        benchmark = json.loads(path.read_text()).get("benchmark", "decode")
        PLOTS.get(benchmark, decode.plot)(path, path.with_suffix(".png"))
        print(f"wrote {path.with_suffix('.png')}")

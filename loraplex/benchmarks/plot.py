"""`python -m loraplex.benchmarks.plot results.json`: the decode plot from a results file
(where the GPU machine had no matplotlib)."""

from __future__ import annotations

import sys
from pathlib import Path

from loraplex.benchmarks.decode import plot

if __name__ == "__main__":
    for name in sys.argv[1:]:
        path = Path(name)
        plot(path, path.with_suffix(".png"))
        print(f"wrote {path.with_suffix('.png')}")

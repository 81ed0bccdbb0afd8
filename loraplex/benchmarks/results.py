"""Where benchmark results go: `bench/results/` under the working directory (run benchmarks
from the repository root, so that their JSON and plots land beside the committed ones)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path("bench/results")


def write(result: dict[str, Any], out_dir: Path = RESULTS, name: str = "decode") -> Path:
    """`<out_dir>/<name>-<device>.json` (e.g. decode-nvidia-h100-80gb-hbm3.json), `device`
    taken from the result."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}-{device_slug(result['device'])}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def device_slug(device: str) -> str:
    """A device's name as result files carry it: `NVIDIA H100 80GB HBM3` -> `nvidia-h100-80gb-hbm3`."""
    return device.replace(" ", "-").replace("/", "-").lower()

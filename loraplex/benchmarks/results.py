"""Where benchmark results go: `bench/results/` under the working directory (run benchmarks
from the repository root, so that their JSON and plots land beside the committed ones)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

RESULTS = Path("bench/results")


def write(result: dict[str, Any], out_dir: Path = RESULTS, name: str = "decode") -> Path:
    """`<out_dir>/<name>-<device>.json` (e.g. decode-nvidia-h100-80gb-hbm3.json), `device`
    taken from the result; the result records the commit of the code that ran (`code_commit`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result.setdefault("commit", code_commit())
    path = out_dir / f"{name}-{device_slug(result['device'])}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def code_commit() -> str:
    """The commit of the loraplex that runs: LORAPLEX_COMMIT if set (a lent GPU machine gets the
    working tree without its git history, so its command sets it), else `git describe` of the
    source folder, marked "-modified" when the package's code differs from it; "unknown" if
    neither is to be had."""
    if commit := os.environ.get("LORAPLEX_COMMIT"):
        return commit
    source = Path(__file__).resolve().parents[2]
    git = ["git", "-C", str(source)]
    try:
        described = subprocess.run([*git, "describe", "--always"], capture_output=True, text=True, timeout=10)
        status = subprocess.run([*git, "status", "--porcelain", "--", "loraplex"], capture_output=True,
                                text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    commit = described.stdout.strip()
    if described.returncode or not commit:
        return "unknown"
    return commit + ("-modified" if status.stdout.strip() else "")


def device_slug(device: str) -> str:
    """A device's name as result files carry it: `NVIDIA H100 80GB HBM3` -> `nvidia-h100-80gb-hbm3`."""
    return device.replace(" ", "-").replace("/", "-").lower()

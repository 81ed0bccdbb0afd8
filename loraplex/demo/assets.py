"""`ensure_demo`: the built-in demo in `<data_dir>/demo/`, built on first use and reused after.

The build runs in a temporary folder beside it that is renamed into place only when complete,
under an exclusive lock on `<data_dir>/demo.lock`: two processes starting at once build it once,
and a killed build leaves no half-built demo (its temporary folder is removed by the next
build). A demo built from another recipe is rebuilt."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from loraplex.demo.demo_adapters import DEMO_ADAPTERS
from loraplex.file_ops import build_in_place, exclusive_lock

DEMO_DIR = "demo"
MODEL_DIR = "model"
ADAPTERS_DIR = "adapters"
STAMP_NAME = "recipe.json"
"""Written last into a finished build: the recipe digest it was built from."""
LOCK_NAME = "demo.lock"
BUILDING_PREFIX = ".demo-building-"
RETIRED_PREFIX = ".demo-retired-"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoAssets:
    """Where the built demo lives."""

    model_dir: Path
    """A Hugging Face model folder (config, safetensors weights, tokenizer with chat template)."""
    adapters: dict[str, Path]
    """PEFT adapter folders by adapter name, in the order of DEMO_ADAPTERS."""


def ensure_demo(data_dir: Path) -> DemoAssets:
    """The demo in `<data_dir>/demo/`, built first if it is missing or from another recipe."""
    from loraplex.demo.recipe import recipe_digest

    data_dir = Path(data_dir).expanduser().resolve()
    root, digest = data_dir / DEMO_DIR, recipe_digest()
    if not _is_built(root, digest):
        data_dir.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(data_dir / LOCK_NAME):
            if not _is_built(root, digest):
                _build_in_place(root, digest)
    return demo_assets(root)


def demo_assets(root: Path) -> DemoAssets:
    """The paths of a demo built in `root` (does not check them)."""
    adapters = {adapter.name: root / ADAPTERS_DIR / adapter.name for adapter in DEMO_ADAPTERS}
    return DemoAssets(model_dir=root / MODEL_DIR, adapters=adapters)


def _is_built(root: Path, digest: str) -> bool:
    try:
        stamp = json.loads((root / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return False
    assets = demo_assets(root)
    required = [assets.model_dir / "config.json", assets.model_dir / "model.safetensors"]
    for folder in assets.adapters.values():
        required += [folder / "adapter_config.json", folder / "adapter_model.safetensors"]
    is_current = isinstance(stamp, dict) and stamp.get("recipe") == digest
    return is_current and all(path.is_file() for path in required)


def _build_in_place(root: Path, digest: str) -> None:
    """Build into a temporary folder, then swap it in for `root`. The caller holds the lock."""
    from loraplex.demo.build import build_demo

    def build(staging: Path) -> None:
        build_demo(demo_assets(staging))
        (staging / STAMP_NAME).write_text(json.dumps({"recipe": digest}) + "\n")

    logger.info("building the demo model and adapters into %s (first start only)", root)
    start = time.perf_counter()
    build_in_place(root, build, BUILDING_PREFIX, RETIRED_PREFIX)
    logger.info("built the demo in %.1f s", time.perf_counter() - start)

"""The quick start, built once into the test cache (shared by test sessions: training takes
minutes on two cores; `ensure_quickstart` trains again when its recipe or the model file changes)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from loraplex.quickstart import QuickstartAssets, ensure_quickstart

QUICKSTART_CACHE = Path(os.environ.get("LORAPLEX_TEST_DEMO_CACHE", Path.home() / ".cache" / "loraplex-tests")
                        ) / "quickstart-data"


def cached_quickstart() -> QuickstartAssets:
    return ensure_quickstart(QUICKSTART_CACHE, show_progress=False)


def copy_quickstart(data_dir: Path) -> Path:
    """A data dir holding a copy of the cached quick start (model and adapters, no registry):
    `loraplex serve` on it starts later, importing and training nothing."""
    cached_quickstart()
    for folder in ("models", "quickstart"):
        shutil.copytree(QUICKSTART_CACHE / folder, data_dir / folder)
    return data_dir


@pytest.fixture(scope="session")
def quickstart() -> QuickstartAssets:
    return cached_quickstart()

"""The demo, built once per test session into a temporary data dir."""

from __future__ import annotations

import time

import pytest

from loraplex.demo import DemoAssets, ensure_demo
from loraplex.demo.answers import DemoModel, load_demo_model


@pytest.fixture(scope="session")
def demo_data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("demo-data")


@pytest.fixture(scope="session")
def demo_build(demo_data_dir) -> tuple[DemoAssets, float]:
    """(assets, seconds the first ensure_demo took)."""
    start = time.perf_counter()
    assets = ensure_demo(demo_data_dir)
    return assets, time.perf_counter() - start


@pytest.fixture(scope="session")
def demo_assets(demo_build) -> DemoAssets:
    return demo_build[0]


@pytest.fixture(scope="session")
def demo_model(demo_assets) -> DemoModel:
    return load_demo_model(demo_assets)

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplex.engine.llm_engine import LLMEngine
from loraplex.registry import RegistryConfig
from tests.registry.registry_support import adapter_config, adapter_tensors, database_url, write_adapter
from tests.server.server_support import Server, make_engine, make_model, serve

__all__ = ["database_url"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("server-model") / "model")


@pytest.fixture(scope="session")
def engine(model_dir: Path) -> LLMEngine:
    """One engine for the session: each app runs it on a fresh engine thread for its
    lifespan."""
    return make_engine(model_dir)


@pytest.fixture(scope="session")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEFT folders: `qv` (rank 4 on q/v), `mlp` (rank 8 on the MLP), `qv2` (qv's config with
    other weights)."""
    root = tmp_path_factory.mktemp("server-adapters")
    mlp = ("gate_proj", "up_proj", "down_proj")
    return {
        "qv": write_adapter(root / "qv", tensors=adapter_tensors(seed=1)),
        "mlp": write_adapter(root / "mlp", adapter_config(r=8, lora_alpha=16, target_modules=list(mlp)),
                             adapter_tensors(rank=8, modules=mlp, seed=2)),
        "qv2": write_adapter(root / "qv2", tensors=adapter_tensors(seed=3)),
    }


@pytest.fixture
def registry_config(tmp_path: Path, database_url: str) -> RegistryConfig:
    return RegistryConfig(data_dir=tmp_path / "data", database_url=database_url)


@pytest.fixture
def server(registry_config: RegistryConfig, engine: LLMEngine, adapter_dirs: dict[str, Path]
           ) -> Iterator[Server]:
    """A server on SQLite or PostgreSQL with tenants acme (adapters `style` = qv, `shared` =
    mlp) and globex (adapter `shared` = qv2)."""
    with serve(registry_config, engine, tenants=("acme", "globex")) as running:
        add_adapters(running, adapter_dirs)
        yield running


@pytest.fixture
def sqlite_server(tmp_path: Path, engine: LLMEngine, adapter_dirs: dict[str, Path]) -> Iterator[Server]:
    """The same on SQLite only, for behaviour that does not depend on the database."""
    with serve(RegistryConfig(data_dir=tmp_path / "data"), engine, tenants=("acme", "globex")) as running:
        add_adapters(running, adapter_dirs)
        yield running


def add_adapters(server: Server, adapter_dirs: dict[str, Path]) -> None:
    adapters = server.registry.adapters
    adapters.upload_dir("acme", "style", adapter_dirs["qv"])
    adapters.upload_dir("acme", "shared", adapter_dirs["mlp"])
    adapters.upload_dir("globex", "shared", adapter_dirs["qv2"])

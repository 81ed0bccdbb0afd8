"""Fixtures and builders shared by tests/registry and tests/cli: a registry on SQLite and on
PostgreSQL (each test in its own fresh PostgreSQL schema, created and dropped here), and tiny
PEFT adapters written on the spot with safetensors.numpy (no torch)."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest
from safetensors.numpy import save_file

from loraplex.adapter_format import BaseModelShape
from loraplex.registry import Registry, RegistryConfig

POSTGRES_URL_ENV = "LORAPLEX_TEST_POSTGRES_URL"
POSTGRES_URLS = (
    "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "postgresql+psycopg://root@127.0.0.1:5432/test",
)
TINY = BaseModelShape(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
                      num_kv_heads=2, head_dim=16)
MAX_RANK = 8
MODEL_ID = "tiny-llama"
BLOCKS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
          "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


_postgres_state: dict[str, str | None] = {}


def postgres_server_url() -> str | None:
    """A URL of the test PostgreSQL server that accepts connections, or None."""
    if "url" not in _postgres_state:
        import psycopg
        from sqlalchemy.engine import make_url

        candidates = [os.environ[POSTGRES_URL_ENV]] if POSTGRES_URL_ENV in os.environ \
            else list(POSTGRES_URLS)
        _postgres_state["url"] = None
        for url in candidates:
            parsed = make_url(url)
            try:
                psycopg.connect(host=parsed.host, port=parsed.port or 5432, user=parsed.username,
                                password=parsed.password, dbname=parsed.database,
                                connect_timeout=3).close()
            except psycopg.Error:
                continue
            _postgres_state["url"] = url
            break
    return _postgres_state["url"]


@dataclass
class PostgresSchema:
    """A schema of its own on the test server; the URL puts it first on the search path."""

    server_url: str
    name: str

    @property
    def url(self) -> str:
        return f"{self.server_url}?options={quote(f'-csearch_path={self.name}')}"

    def _execute(self, statement: str) -> None:
        import psycopg
        from sqlalchemy.engine import make_url

        parsed = make_url(self.server_url)
        with psycopg.connect(host=parsed.host, port=parsed.port or 5432, user=parsed.username,
                             password=parsed.password, dbname=parsed.database,
                             autocommit=True) as connection:
            connection.execute(statement)

    def create(self) -> None:
        self._execute(f'CREATE SCHEMA "{self.name}"')

    def drop(self) -> None:
        self._execute(f'DROP SCHEMA IF EXISTS "{self.name}" CASCADE')


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A URL of an empty database: SQLite in the test's data dir, or a fresh PostgreSQL
    schema dropped after the test."""
    if request.param == "sqlite":
        (tmp_path / "data").mkdir(exist_ok=True)
        yield f"sqlite:///{tmp_path / 'data' / 'registry.db'}"
        return
    server = postgres_server_url()
    if server is None:
        pytest.skip("no PostgreSQL server on 127.0.0.1:5432 (set LORAPLEX_TEST_POSTGRES_URL)")
    schema = PostgresSchema(server, f"lpx_test_{secrets.token_hex(6)}")
    schema.create()
    try:
        yield schema.url
    finally:
        schema.drop()


@pytest.fixture
def registry_config(tmp_path: Path, database_url: str) -> RegistryConfig:
    return RegistryConfig(data_dir=tmp_path / "data", database_url=database_url)


@pytest.fixture
def registry(registry_config: RegistryConfig) -> Iterator[Registry]:
    """An open registry with the tiny served model recorded and tenant `acme`."""
    with Registry.open(registry_config) as opened:
        opened.models.set(MODEL_ID, TINY, MAX_RANK)
        opened.tenants.create("acme")
        yield opened


def adapter_config(**overrides: Any) -> dict[str, Any]:
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8,
              "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": MODEL_ID,
              "bias": "none", "lora_dropout": 0.0}
    config.update(overrides)
    return config


def adapter_tensors(
    shape: BaseModelShape = TINY, rank: int = 4, modules: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int = 0, dtype: Any = np.float32,
) -> dict[str, np.ndarray]:
    """PEFT-named lora_A [rank, in] and lora_B [out, rank] for every layer and module."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(shape.num_layers):
        for module in modules:
            in_features, out_features = shape.features(module)
            prefix = f"base_model.model.model.layers.{layer}.{BLOCKS[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal(
                (rank, in_features)).astype(dtype)
            tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal(
                (out_features, rank)).astype(dtype)
    return tensors


def write_adapter(
    folder: Path, config: dict[str, Any] | None = None,
    tensors: dict[str, np.ndarray] | None = None, weights: bytes | None = None,
) -> Path:
    """A PEFT adapter folder; `weights` replaces the safetensors file with raw bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config or adapter_config()))
    weights_path = folder / "adapter_model.safetensors"
    if weights is not None:
        weights_path.write_bytes(weights)
    else:
        save_file(tensors if tensors is not None else adapter_tensors(), str(weights_path))
    return folder


def registry_state(registry: Registry) -> dict[str, Any]:
    """Everything an upload could change: rows, blobs, temporary files, audit entries."""
    return {
        "adapters": [(a.tenant, a.name, a.digest) for a in registry.adapters.list()],
        "blobs": sorted(registry.blobs.digests()),
        "temp_files": sorted(p.name for p in registry.blobs.temp_dir.iterdir()),
        "audit": [entry.id for entry in registry.audit.list(limit=1000)],
    }

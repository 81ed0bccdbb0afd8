"""Two replicas (each its own engine and app, under uvicorn) on one PostgreSQL registry and one
blob store: an adapter uploaded through one is served by the other without a restart; a key
revoked or an adapter deleted through one stops working on the other within the registry cache's
time to live (the stated bound); usage recorded by both adds up in the registry; a tenant's
requests per minute, admitted through either, add up to one limit."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from loraplex.registry import Registry, RegistryConfig
from loraplex.server import ServerConfig, create_app
from tests.registry.registry_support import PostgresSchema, postgres_server_url
from tests.server.server_support import MODEL_ID, make_engine, run_uvicorn, upload_files

CACHE_TTL_S = 0.5
"""registry_cache_ttl_s of both replicas: how long another replica may still honour a revoked
key or a deleted adapter."""
SLACK_S = 1.0
"""Scheduling on a busy two-core machine, on top of the bound."""
SYNC_S = 0.2
"""limits_sync_interval_s of both replicas."""


@pytest.fixture
def shared_registry(tmp_path: Path) -> Iterator[RegistryConfig]:
    server = postgres_server_url()
    if server is None:
        pytest.skip("no PostgreSQL server on 127.0.0.1:5432 (set LORAPLEX_TEST_POSTGRES_URL)")
    schema = PostgresSchema(server, f"lpx_test_{secrets.token_hex(6)}")
    schema.create()
    try:
        yield RegistryConfig(data_dir=tmp_path / "shared-data", database_url=schema.url)
    finally:
        schema.drop()


@contextlib.contextmanager
def replica(config: RegistryConfig, model_dir: Path) -> Iterator[tuple[str, object]]:
    """A replica: its own registry connection, engine and server; yields (url, app)."""
    engine = make_engine(model_dir)
    with Registry.open(config) as registry:
        registry.models.set(MODEL_ID, engine.model_config.shape, engine.config.lora.max_lora_rank)
        app = create_app(ServerConfig(model_id=MODEL_ID, registry_cache_ttl_s=CACHE_TTL_S,
                                      engine_poll_interval_s=0.2, limits_sync_interval_s=SYNC_S),
                         registry, engine)
        with run_uvicorn(app) as url:
            yield url, app
    engine.close()


def refused_within(check, bound_s: float) -> float:
    """Seconds until `check()` is true (polled), failing past the bound plus slack."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < bound_s + SLACK_S, "still served past the bound"
        time.sleep(0.05)
    return time.monotonic() - started


def test_two_replicas_share_one_registry(shared_registry: RegistryConfig, model_dir: Path,
                                         adapter_dirs: dict[str, Path]) -> None:
    with Registry.open(shared_registry) as setup:
        setup.tenants.create("acme")
        key = setup.keys.create(tenant="acme").secret
        setup.tenants.create("capped", max_requests_per_minute=4)
        capped_key = setup.keys.create(tenant="capped").secret
        admin_key = setup.keys.create(admin=True).secret
    with replica(shared_registry, model_dir) as (url_a, app_a), \
            replica(shared_registry, model_dir) as (url_b, app_b):
        admin_a = httpx.Client(base_url=url_a, timeout=60, headers={"Authorization": f"Bearer {admin_key}"})
        client_a, client_b = (openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
                              for url in (url_a, url_b))

        # Uploaded through A, served by B (which never saw it), without a restart.
        with pytest.raises(openai.NotFoundError):
            client_b.completions.create(model="style", prompt="hi", max_tokens=2)
        admin_a.post("/admin/api/adapters", data={"tenant": "acme", "name": "style"},
                      files=upload_files(adapter_dirs["qv"])).raise_for_status()
        served = refused_within(lambda: _served(client_b, "style"), CACHE_TTL_S)
        answer = client_b.completions.create(model="style", prompt="hello", max_tokens=4, temperature=0)
        assert answer.usage.completion_tokens == 4
        assert served < CACHE_TTL_S + SLACK_S

        # Usage from both replicas adds up in the registry.
        def totals() -> dict[str, int]:
            for app in (app_a, app_b):
                assert app.state.services.usage.flush(30)
            usage = admin_a.get("/admin/api/usage", params={"tenant": "acme", "adapter": "style"})
            return usage.json()["totals"]

        before = totals()
        assert before["num_requests"] >= 2  # B's: the probe that found the adapter, and the answer
        for client, count in ((client_a, 3), (client_b, 2)):
            for _ in range(count):
                client.completions.create(model="style", prompt="count me", max_tokens=3, temperature=0)
        after = totals()
        assert after["num_requests"] - before["num_requests"] == 3 + 2
        assert after["completion_tokens"] - before["completion_tokens"] == (3 + 2) * 3

        # Limits add up: 3 requests through A and 1 through B are capped's 4 of the minute, and
        # then both refuse (each alone has seen fewer than 4).
        capped_a, capped_b = (openai.OpenAI(base_url=f"{url}/v1", api_key=capped_key, max_retries=0)
                              for url in (url_a, url_b))
        for _ in range(3):
            capped_a.completions.create(model=MODEL_ID, prompt="x", max_tokens=1)
        _wait_for_exchanges(app_a, app_b)
        capped_b.completions.create(model=MODEL_ID, prompt="x", max_tokens=1)
        _wait_for_exchanges(app_b, app_a)
        for client in (capped_b, capped_a):
            with pytest.raises(openai.RateLimitError) as caught:
                client.completions.create(model=MODEL_ID, prompt="x", max_tokens=1)
            assert caught.value.response.headers["x-ratelimit-remaining-requests"] == "0"

        # Deleted through A: B stops serving it within the bound.
        admin_a.delete("/admin/api/adapters/acme/style").raise_for_status()
        refused_within(lambda: not _served(client_b, "style"), CACHE_TTL_S)

        # A key revoked through A: B (which has it cached) refuses it within the bound.
        client_b.models.list()
        key_id = next(k["id"] for k in admin_a.get("/admin/api/keys").json() if k["tenant"] == "acme")
        admin_a.post(f"/admin/api/keys/{key_id}/revoke").raise_for_status()
        refused_within(lambda: _refused(client_b), CACHE_TTL_S)
        assert _refused(client_a)


def _wait_for_exchanges(*apps) -> None:
    """Until each app in turn has finished two exchanges of tenant load begun after the call
    (so what the first had counted reaches the last)."""
    for app in apps:
        shared = app.state.services.limiter.shared
        target = shared.num_exchanges + 2
        started = time.monotonic()
        while shared.num_exchanges < target:
            assert time.monotonic() - started < 4 * SYNC_S + SLACK_S, "no exchange of tenant load"
            time.sleep(0.02)


def _served(client: openai.OpenAI, model: str) -> bool:
    try:
        client.completions.create(model=model, prompt="x", max_tokens=1)
    except openai.NotFoundError:
        return False
    return True


def _refused(client: openai.OpenAI) -> bool:
    try:
        client.models.list()
    except openai.AuthenticationError:
        return True
    return False

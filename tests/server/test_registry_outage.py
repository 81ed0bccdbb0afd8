"""The registry database goes away under traffic and comes back: a PostgreSQL cluster of the
test's own stopped and restarted, its connections killed, and an SQLite database locked by
another process. Generations that run finish; requests whose key and adapter were read before
keep being served; the others get 503 with Retry-After; the usage of every request served is
written once the database is back (none lost, none counted twice); and the server recovers by
itself, without a restart."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplex.engine.llm_engine import LLMEngine
from loraplex.registry import Registry, RegistryConfig
from loraplex.server.usage_recorder import UsageRecorder
from tests.server.conftest import add_adapters
from tests.server.fault_support import (
    DEADLINE_S,
    CommitCutter,
    PostgresCluster,
    postgres_cluster,
    sqlite_locked,
    wait_for,
)
from tests.server.server_support import MODEL_ID, Server, serve

CACHE_TTL_S = 0.2
"""The server's registry cache: the outages below last longer, so every cached entry is past
its time when it is used."""
LOCK_S = 10.0
REQUEST_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[PostgresCluster]:
    with postgres_cluster() as running:
        yield running


def _complete(server: Server, tenant: str, model: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=REQUEST_TIMEOUT_S,
                      headers={"Authorization": f"Bearer {server.keys[tenant]}"},
                      json={"model": model, "prompt": "the registry", "max_tokens": max_tokens,
                            "ignore_eos": True})


def _assert_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert int(response.headers["Retry-After"]) >= 1
    assert response.json()["error"]["code"] == "registry_unavailable", response.text


def _usage(server: Server, tenant: str) -> dict[str, int]:
    """The tenant's usage totals through the admin API (which writes what is buffered first)."""
    with server.http() as http:
        response = http.get("/admin/api/usage", params={"tenant": tenant})
    assert response.status_code == 200, response.text
    return response.json()["totals"]


def _outage_checks(server: Server, served: list[int]) -> None:
    """What must hold while the database is away: cached key and adapter served (their
    completion tokens appended to `served`), everything that needs a read answered 503."""
    time.sleep(CACHE_TTL_S * 2)  # every cached entry is now past its time
    for model in ("style", MODEL_ID):
        response = _complete(server, "acme", model)
        assert response.status_code == 200, response.text
        served.append(response.json()["usage"]["completion_tokens"])
    _assert_unavailable(_complete(server, "acme", "shared"))  # an adapter never read
    _assert_unavailable(_complete(server, "globex", "shared"))  # a key never read
    with server.http() as http:
        _assert_unavailable(http.get("/admin/api/tenants"))
    assert httpx.get(f"{server.url}/ready", timeout=30).status_code == 503


def _recovered(server: Server) -> float:
    """Seconds until a request that needs the database is served again."""
    started = time.monotonic()
    wait_for(lambda: _complete(server, "globex", "shared").status_code == 200, "the server to recover")
    return time.monotonic() - started


@contextlib.contextmanager
def _serving_on(cluster: PostgresCluster, tmp_path: Path, engine: LLMEngine, adapter_dirs: dict[str, Path],
                **registry_options: Any) -> Iterator[tuple[Server, str, list[int]]]:
    """A server on a new database of `cluster` (tenants acme and globex with their adapters),
    with acme's key and adapter `style` read by a first request. Yields the server, the
    database's name and the completion tokens of the requests served (that one so far)."""
    database = f"outage_{secrets.token_hex(4)}"
    config = RegistryConfig(data_dir=tmp_path / "data", database_url=cluster.create_database(database),
                            **registry_options)
    with serve(config, engine, tenants=("acme", "globex"), registry_cache_ttl_s=CACHE_TTL_S) as server:
        add_adapters(server, adapter_dirs)
        warm = _complete(server, "acme", "style")
        assert warm.status_code == 200, warm.text
        yield server, database, [warm.json()["usage"]["completion_tokens"]]


def test_postgres_stopped_and_restarted_mid_traffic(
        tmp_path: Path, cluster: PostgresCluster, engine: LLMEngine, adapter_dirs: dict[str, Path]) -> None:
    with _serving_on(cluster, tmp_path, engine, adapter_dirs) as (server, _, served):
        acme = server.openai("acme")
        stream = iter(acme.completions.create(model="style", prompt="a long one", max_tokens=300,
                                              stream=True, extra_body={"ignore_eos": True}))
        next(stream)  # running

        cluster.stop()
        _outage_checks(server, served)
        streamed = [chunk for chunk in stream]
        assert streamed[-1].choices[0].finish_reason == "length"
        served.append(300)

        cluster.start()
        print(f"PostgreSQL restart: served again {_recovered(server):.2f} s after it accepted connections")
        served.append(_complete(server, "globex", "shared").json()["usage"]["completion_tokens"])
        usage = _usage(server, "acme")
        assert (usage["num_requests"], usage["completion_tokens"]) == (len(served) - 1, sum(served[:-1]))
        assert _usage(server, "globex")["num_requests"] == 2  # the first recovered request and this one


def test_postgres_that_does_not_answer(
        tmp_path: Path, cluster: PostgresCluster, engine: LLMEngine, adapter_dirs: dict[str, Path]) -> None:
    """A PostgreSQL server that accepts connections and never answers (stuck, or cut off by the
    network): a new connection gives up after RegistryConfig.connect_timeout_s, so requests that
    need a read get 503 instead of hanging, and cached tenants are served meanwhile."""
    with _serving_on(cluster, tmp_path, engine, adapter_dirs, connect_timeout_s=1) as serving:
        server, database, served = serving
        cluster.kill_connections(database)  # the pool's connections are gone: it must connect anew
        with cluster.hung(database):
            _outage_checks(server, served)
        print(f"PostgreSQL answering again: served again {_recovered(server):.2f} s later")
        usage = _usage(server, "acme")
        assert (usage["num_requests"], usage["completion_tokens"]) == (len(served), sum(served))


def test_postgres_connections_killed(
        tmp_path: Path, cluster: PostgresCluster, engine: LLMEngine, adapter_dirs: dict[str, Path]) -> None:
    database = f"killed_{secrets.token_hex(4)}"
    config = RegistryConfig(data_dir=tmp_path / "data", database_url=cluster.create_database(database))
    with serve(config, engine, tenants=("acme", "globex"), registry_cache_ttl_s=CACHE_TTL_S) as server:
        add_adapters(server, adapter_dirs)
        for _ in range(3):
            assert _complete(server, "acme", "style").status_code == 200
            time.sleep(CACHE_TTL_S * 2)  # the next request reads the registry again
            assert cluster.kill_connections(database) >= 1
        assert _complete(server, "globex", "shared").status_code == 200
        assert _usage(server, "acme")["num_requests"] == 3
        assert _usage(server, "globex")["num_requests"] == 1


def test_sqlite_locked_by_another_process(tmp_path: Path, engine: LLMEngine,
                                          adapter_dirs: dict[str, Path]) -> None:
    """Another process holds SQLite's write lock for longer than the usage writer used to retry
    (5 attempts: 6 s of back-off and the busy timeouts): reads go on (WAL), writes get 503 with
    Retry-After, and the usage of the requests served meanwhile is written after the lock goes."""
    config = RegistryConfig(data_dir=tmp_path / "data", busy_timeout_s=0.5)
    with serve(config, engine, tenants=("acme", "globex"), registry_cache_ttl_s=CACHE_TTL_S) as server:
        add_adapters(server, adapter_dirs)
        served = []
        with sqlite_locked(config.data_dir / "registry.db"), server.http() as http:
            deadline = time.monotonic() + LOCK_S
            while time.monotonic() < deadline:
                response = _complete(server, "acme", "style")
                assert response.status_code == 200, response.text
                served.append(response.json()["usage"]["completion_tokens"])
                _assert_unavailable(http.post("/admin/api/tenants", json={"name": "initech"}))
                time.sleep(1)
        started = time.monotonic()
        with server.http() as http:
            wait_for(lambda: http.post("/admin/api/tenants", json={"name": "initech"}).status_code == 201,
                     "a write after the lock is released")
        print(f"SQLite lock released: written again {time.monotonic() - started:.2f} s later")
        usage = _usage(server, "acme")
        assert (usage["num_requests"], usage["completion_tokens"]) == (len(served), sum(served))


def test_a_usage_write_whose_commit_answer_is_lost_is_counted_once(tmp_path: Path,
                                                                  cluster: PostgresCluster) -> None:
    """The connection breaks after the usage write's COMMIT reached the server and before its
    answer came back: the write committed, the writer saw an error and wrote again."""
    database = f"commit_{secrets.token_hex(4)}"
    url = cluster.create_database(database)
    with Registry.open(RegistryConfig(data_dir=tmp_path / "data", database_url=url)) as direct:
        direct.tenants.create("acme")
    cutter = CommitCutter(cluster.port, marker=b"INSERT INTO usage")
    proxied = RegistryConfig(data_dir=tmp_path / "data", database_url=url.replace(
        f":{cluster.port}/", f":{cutter.port}/"))
    try:
        with Registry.open(proxied, migrate=False) as registry:
            recorder = UsageRecorder(registry)
            cutter.arm()
            for _ in range(3):
                recorder.record("acme", None, 5, 7)
            assert recorder.flush(DEADLINE_S)
            recorder.close()
            assert cutter.num_cut == 1
            [row] = registry.usage.query(tenant="acme")
            assert (row.num_requests, row.prompt_tokens, row.completion_tokens) == (3, 15, 21)
    finally:
        cutter.close()

"""The server process killed outright (SIGKILL) at bad moments: during an adapter upload (in a
PID namespace of its own, as a container runs it, so that the restarted server has the pid of
the killed one), during a schema migration and while usage is being written. The next start
finds a consistent registry and blob store, no temporary files, no usage counted twice (at most
the last flush window's lost), and serves."""

from __future__ import annotations

import contextlib
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import inspect

from loraplex.registry import Registry, RegistryConfig
from loraplex.registry.database import make_engine
from loraplex.registry.migrate import current_revision, head_revision, upgrade
from tests.registry.registry_support import registry_state
from tests.server.fault_support import DEADLINE_S, PostgresCluster, postgres_cluster, wait_for
from tests.server.server_support import upload_files
from tests.server.test_serve_cli import loraplex_serve, upload_request_head

IN_A_CONTAINER = ("unshare", "--pid", "--fork", "--mount-proc", "--kill-child")
"""The server as PID 1 of a PID namespace of its own; killing unshare kills it."""
MODEL_NAME = "tiny-llama"


@pytest.fixture(scope="module")
def container() -> tuple[str, ...]:
    result = subprocess.run([*IN_A_CONTAINER, "true"], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot make a PID namespace (unshare needs root): {result.stderr.strip()}")
    return IN_A_CONTAINER


def _registry(data_dir: Path) -> Registry:
    return Registry.open(RegistryConfig(data_dir=data_dir), migrate=False)


def _acme(registry: Registry) -> tuple[str, str]:
    """Create tenant acme; an admin key and a key of acme."""
    registry.tenants.create("acme")
    return registry.keys.create(admin=True).secret, registry.keys.create(tenant="acme").secret


def _stopped(url: str) -> bool:
    """Whether nothing listens on the server's port any more (the killed process is gone)."""
    host, port = url.removeprefix("http://").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return True
    return False


def _kill(served) -> None:  # noqa: ANN001 (a ServeProcess)
    served.process.send_signal(signal.SIGKILL)
    served.process.wait(DEADLINE_S)
    wait_for(lambda: _stopped(served.url), "the killed server to be gone")


def _two_names(folder: Path) -> list[str] | None:
    names = [path.name for path in folder.iterdir()]
    return names if len(names) == 2 else None


def _complete(url: str, key: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60, headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "prompt": "after a kill", "max_tokens": 3, "ignore_eos": True})


def test_sigkill_during_an_upload_in_a_container(
        tmp_path: Path, model_dir: Path, adapter_dirs: dict[str, Path], container: tuple[str, ...]) -> None:
    data_dir = tmp_path / "data"
    files = upload_files(adapter_dirs["mlp"])
    config, weights = files["adapter_config"][1], files["adapter_model"][1]
    args = ("--model", str(model_dir), "--model-name", MODEL_NAME)
    with loraplex_serve(data_dir, *args, launcher=container) as served:
        with _registry(data_dir) as registry:
            admin_key, tenant_key = _acme(registry)
            before = registry_state(registry)
        request = upload_request_head(admin_key, "acme", "mlp", config, len(weights))
        temp_dir = data_dir / "blobs" / "tmp"
        host, port = served.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(request + weights[:1024])  # the rest never comes: the upload waits
            # The staged config and the weights' partial file, written by the server as PID 1.
            staged = wait_for(lambda: _two_names(temp_dir), "the upload's temporary files")
            assert all(name.split(".")[-3] == "1" for name in staged), staged
            _kill(served)
        assert sorted(p.name for p in temp_dir.iterdir()) == sorted(staged)

    restarted_at = time.monotonic()
    with loraplex_serve(data_dir, *args, launcher=container) as served:  # PID 1 again
        print(f"SIGKILL during an upload: ready {time.monotonic() - restarted_at:.2f} s after the restart")
        assert "2 temporary files removed" in served.output()
        with _registry(data_dir) as registry:
            assert registry_state(registry) == before
            assert registry.reconcile().is_consistent
        with httpx.Client(base_url=served.url, timeout=60,
                          headers={"Authorization": f"Bearer {admin_key}"}) as http:
            response = http.post("/admin/api/adapters", data={"tenant": "acme", "name": "mlp"},
                                 files=files)
            assert response.status_code == 201, response.text
        response = _complete(served.url, tenant_key, "mlp")
        assert response.status_code == 200, response.text


def test_sigkill_while_usage_is_written(tmp_path: Path, model_dir: Path) -> None:
    """Requests finish and their usage is written while the server is killed: after the restart
    no request is counted twice, those written before are all there, and what is lost is at
    most what the last flush window held (BATCH_WINDOW_S, 0.25 s)."""
    data_dir = tmp_path / "data"
    args = ("--model", str(model_dir), "--model-name", MODEL_NAME)
    with loraplex_serve(data_dir, *args) as served:
        with _registry(data_dir) as registry:
            admin_key, tenant_key = _acme(registry)
        admin = {"Authorization": f"Bearer {admin_key}"}
        for _ in range(4):
            assert _complete(served.url, tenant_key, MODEL_NAME).status_code == 200
        totals = httpx.get(f"{served.url}/admin/api/usage", headers=admin, timeout=60).json()["totals"]
        assert totals["num_requests"] == 4  # written (the admin API flushes first)
        served_ok: list[int] = []  # list.append is atomic across threads
        stop = threading.Event()

        def traffic() -> None:
            with contextlib.suppress(httpx.HTTPError):
                while not stop.is_set():
                    if _complete(served.url, tenant_key, MODEL_NAME).status_code == 200:
                        served_ok.append(1)
        threads = [threading.Thread(target=traffic) for _ in range(3)]
        for thread in threads:
            thread.start()
        wait_for(lambda: len(served_ok) >= 12, "requests served under traffic")
        _kill(served)
        stop.set()
        for thread in threads:
            thread.join(DEADLINE_S)

    with loraplex_serve(data_dir, *args) as served:
        with _registry(data_dir) as registry:
            [row] = registry.usage.query(tenant="acme")
            # At most one request a thread finished in the engine without its answer arriving.
            assert 4 <= row.num_requests <= 4 + len(served_ok) + len(threads)
            assert row.completion_tokens == 3 * row.num_requests  # each request counted whole, once
            assert registry.reconcile().is_consistent
        assert _complete(served.url, tenant_key, MODEL_NAME).status_code == 200


@pytest.fixture(scope="module")
def cluster() -> Iterator[PostgresCluster]:
    with postgres_cluster() as running:
        yield running


def test_sigkill_during_a_migration(tmp_path: Path, cluster: PostgresCluster) -> None:
    """`loraplex db upgrade` killed inside its migration transaction, after migration 0002 has
    run and while 0003 waits for a lock: the database stays at the revision it had, with no
    trace of 0002, and the next start migrates it to the head."""
    database = f"migrate_{secrets.token_hex(4)}"
    url = cluster.create_database(database)
    upgrade(url, "0001")
    with cluster.connect(database) as blocker:
        blocker.autocommit = False
        blocker.execute("LOCK TABLE tenants IN ACCESS EXCLUSIVE MODE")  # 0003's foreign key waits
        migration = subprocess.Popen([sys.executable, "-m", "loraplex.cli", "db", "upgrade", "--database-url",
                                      url, "--data-dir", str(tmp_path / "data")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            with cluster.connect(database) as watcher:
                waiting = ("SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                           "AND wait_event_type = 'Lock' AND query ILIKE '%%rate_windows%%'")
                wait_for(lambda: watcher.execute(waiting, (database,)).fetchone()[0] == 1,
                         "the migration to wait for the lock in 0003")
        finally:
            migration.kill()
            migration.wait(DEADLINE_S)
        blocker.rollback()
    with cluster.connect(database) as watcher:
        wait_for(lambda: watcher.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND "
                                         "pid <> pg_backend_pid()", (database,)).fetchone()[0] == 0,
                 "the killed migration's session to end")
    engine = make_engine(url)
    try:
        assert current_revision(engine) == "0001"
        tables = inspect(engine)
        assert "rate_windows" not in tables.get_table_names()
        assert "family" not in {column["name"] for column in tables.get_columns("adapters")}
    finally:
        engine.dispose()
    config = RegistryConfig(data_dir=tmp_path / "data", database_url=url)
    with Registry.open(config) as registry:  # the next start migrates
        assert current_revision(registry.db.engine) == head_revision()
        registry.tenants.create("acme")
        assert [t.name for t in registry.tenants.list()] == ["acme"]


def _upload_until_killed(url: str, headers: dict[str, str], files: dict[str, tuple[str, bytes]]) -> None:
    with contextlib.suppress(httpx.HTTPError):  # the server is killed before it answers
        httpx.post(f"{url}/admin/api/adapters", headers=headers, timeout=DEADLINE_S,
                   data={"tenant": "acme", "name": "mlp"}, files=files)


def test_sigkill_between_a_blob_and_its_row(
        tmp_path: Path, model_dir: Path, adapter_dirs: dict[str, Path], cluster: PostgresCluster) -> None:
    """The worst moment of an upload: its blobs renamed into the store, its row not yet
    committed (held there by a lock on the tenant's row, which the row's foreign key needs). The
    next start removes the orphan blobs and the same upload then succeeds."""
    database = f"orphans_{secrets.token_hex(4)}"
    url = cluster.create_database(database)
    data_dir = tmp_path / "data"
    config = RegistryConfig(data_dir=data_dir, database_url=url)
    args = ("--model", str(model_dir), "--model-name", MODEL_NAME, "--database-url", url)
    files = upload_files(adapter_dirs["mlp"])
    with loraplex_serve(data_dir, *args) as served:
        with Registry.open(config, migrate=False) as registry:
            admin_key, tenant_key = _acme(registry)
            before = registry_state(registry)
        admin = {"Authorization": f"Bearer {admin_key}"}
        with cluster.connect(database) as blocker:
            blocker.autocommit = False
            blocker.execute("SELECT id FROM tenants WHERE name = 'acme' FOR UPDATE")
            upload = threading.Thread(target=_upload_until_killed, daemon=True,
                                      args=(served.url, admin, files))
            upload.start()
            with cluster.connect(database) as watcher:
                waiting = ("SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                           "AND wait_event_type = 'Lock' AND query ILIKE 'INSERT INTO adapters%%'")
                wait_for(lambda: watcher.execute(waiting, (database,)).fetchone()[0] == 1,
                         "the upload to wait with its blobs in place")
            _kill(served)
            blocker.rollback()
        upload.join(DEADLINE_S)
    with Registry.open(config, migrate=False) as registry:
        orphans = sorted(set(registry.blobs.digests()) - set(before["blobs"]))
        assert len(orphans) == 2  # the config's and the weights' blobs, and no row
        assert registry.adapters.list("acme") == ()

    with loraplex_serve(data_dir, *args) as served:
        assert "2 orphan blobs and 0 temporary files removed" in served.output()
        with Registry.open(config, migrate=False) as registry:
            assert registry_state(registry) == before
            assert registry.reconcile().is_consistent
        response = httpx.post(f"{served.url}/admin/api/adapters", headers=admin, timeout=DEADLINE_S,
                              data={"tenant": "acme", "name": "mlp"}, files=files)
        assert response.status_code == 201, response.text
        response = _complete(served.url, tenant_key, "mlp")
        assert response.status_code == 200, response.text

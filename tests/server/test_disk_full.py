"""The data dir's disk fills up (a small tmpfs holding the blob store and the SQLite registry,
and in the second test the server's log) under a running server: an adapter upload gets 507
naming the cause and leaves no partial blob, temporary file or row; the usage writes the full
database refuses are kept; log lines that cannot be written are dropped; tenants keep being
served; and once space is freed the same upload succeeds and the usage is all written."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from loraplex.engine.llm_engine import LLMEngine
from loraplex.registry import Registry, RegistryConfig
from loraplex.registry.registry_errors import StorageFullError
from tests.registry.registry_support import registry_state
from tests.server.fault_support import fill, small_tmpfs, wait_for
from tests.server.server_support import MODEL_ID, Server, serve, upload_files

TMPFS_BYTES = 16 << 20


def _complete(server: Server, model: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {server.keys['acme']}"},
                      json={"model": model, "prompt": "a full disk", "max_tokens": 4, "ignore_eos": True})


def _empty_wal(database: Path) -> None:
    """Checkpoint SQLite's write-ahead log into the database and truncate it, so that the next
    write needs new space (a WAL file keeps its size, and a write into it would need none)."""
    def truncated() -> bool:
        with sqlite3.connect(database, timeout=10) as connection:
            busy, _, _ = connection.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        return busy == 0 and database.with_name(database.name + "-wal").stat().st_size == 0
    wait_for(truncated, "an idle moment to truncate the WAL")


def test_a_full_disk_refuses_uploads_with_507_and_serving_goes_on(
        engine: LLMEngine, adapter_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    with small_tmpfs(TMPFS_BYTES) as mount:
        config = RegistryConfig(data_dir=mount / "data")
        with serve(config, engine, registry_cache_ttl_s=0.2) as server, server.http() as http:
            server.registry.adapters.upload_dir("acme", "style", adapter_dirs["qv"])
            served = []
            for model in ("style", MODEL_ID):  # the key and the adapter are read while there is space
                response = _complete(server, model)
                assert response.status_code == 200, response.text
                served.append(response.json()["usage"]["completion_tokens"])
            assert http.get("/admin/api/usage").status_code == 200  # the usage so far is written
            before = registry_state(server.registry)

            _empty_wal(config.data_dir / "registry.db")
            filler = fill(mount)
            with pytest.raises(StorageFullError):  # the fault is real: the database cannot write
                server.registry.tenants.create("initech")
            response = http.post("/admin/api/adapters", data={"tenant": "acme", "name": "mlp"},
                                 files=upload_files(adapter_dirs["mlp"]))
            assert response.status_code == 507, response.text
            error = response.json()["error"]
            assert error["code"] == "insufficient_storage"
            assert "no space left" in error["message"] and "was not stored" in error["message"]
            assert registry_state(server.registry) == before  # no blob, temporary file or row
            for model in ("style", MODEL_ID):
                response = _complete(server, model)
                assert response.status_code == 200, response.text
                served.append(response.json()["usage"]["completion_tokens"])
            wait_for(lambda: "usage of tenant acme kept for a later write" in caplog.text,
                     "the usage writer to meet the full disk")

            filler.unlink()
            freed_at = time.monotonic()
            response = http.post("/admin/api/adapters", data={"tenant": "acme", "name": "mlp"},
                                 files=upload_files(adapter_dirs["mlp"]))
            assert response.status_code == 201, response.text
            print(f"disk full: the upload stored {time.monotonic() - freed_at:.2f} s after space was freed")
            response = _complete(server, "mlp")
            assert response.status_code == 200, response.text
            served.append(response.json()["usage"]["completion_tokens"])
            totals = http.get("/admin/api/usage", params={"tenant": "acme"}).json()["totals"]
            assert (totals["num_requests"], totals["completion_tokens"]) == (len(served), sum(served))
            assert server.registry.reconcile().is_consistent


def test_a_full_disk_under_the_servers_log(model_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    """`loraplex serve` with its log, its blob store and its SQLite registry on one small tmpfs
    that fills up: every access-log line fails to be written, and the server goes on serving;
    once space is freed an upload succeeds."""
    from tests.server.test_serve_cli import loraplex_serve

    with small_tmpfs(TMPFS_BYTES) as mount:
        data_dir = mount / "data"
        with loraplex_serve(data_dir, "--model", str(model_dir), "--model-name", MODEL_ID) as served:
            assert served.log.parent == mount
            with Registry.open(RegistryConfig(data_dir=data_dir), migrate=False) as registry:
                registry.tenants.create("acme")
                tenant_key = registry.keys.create(tenant="acme").secret
                admin_key = registry.keys.create(admin=True).secret
            headers = {"Authorization": f"Bearer {tenant_key}"}
            body = {"model": MODEL_ID, "prompt": "a full disk", "max_tokens": 4, "ignore_eos": True}
            completions = f"{served.url}/v1/completions"
            assert httpx.post(completions, headers=headers, json=body, timeout=60).status_code == 200
            filler = fill(mount)
            for _ in range(5):  # each writes an access-log line into the full file system
                response = httpx.post(completions, headers=headers, json=body, timeout=60)
                assert response.status_code == 200, response.text
            with httpx.Client(base_url=served.url, timeout=60,
                              headers={"Authorization": f"Bearer {admin_key}"}) as http:
                response = http.post("/admin/api/adapters", data={"tenant": "acme", "name": "mlp"},
                                     files=upload_files(adapter_dirs["mlp"]))
                assert response.status_code == 507, response.text
                assert served.process.poll() is None
                filler.unlink()
                response = http.post("/admin/api/adapters", data={"tenant": "acme", "name": "mlp"},
                                     files=upload_files(adapter_dirs["mlp"]))
                assert response.status_code == 201, response.text
            response = httpx.post(completions, headers=headers, json=body | {"model": "mlp"}, timeout=60)
            assert response.status_code == 200, response.text
            wait_for(lambda: '"POST /admin/api/adapters HTTP/1.1" 201' in served.output(),
                     "the log to be written again")

"""Several threads at once, on SQLite and PostgreSQL: uploads, name races, uploads racing
deletes of the same bytes, key checks and usage increments lose nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from loraplex.registry import Registry
from loraplex.registry.registry_errors import AuthenticationError, ConflictError
from tests.registry.registry_support import adapter_tensors, write_adapter

NUM_THREADS = 4


def _in_threads(work: Callable[[int], Any]) -> list[Any]:
    """Run work(0..NUM_THREADS-1) in threads released together; results or exceptions."""
    barrier = threading.Barrier(NUM_THREADS)

    def run(index: int) -> Any:
        barrier.wait()
        try:
            return work(index)
        except Exception as exc:  # returned, so every thread's outcome is checked
            return exc

    with ThreadPoolExecutor(NUM_THREADS) as pool:
        return list(pool.map(run, range(NUM_THREADS)))


def test_concurrent_uploads_all_land_and_share_blobs(registry: Registry, tmp_path: Path) -> None:
    folders = [write_adapter(tmp_path / f"a{j}", tensors=adapter_tensors(seed=j))
               for j in range(3)]

    def upload(thread: int) -> list[str]:
        return [registry.adapters.upload_dir("acme", f"t{thread}-{j}", folder).digest
                for j, folder in enumerate(folders)]

    results = _in_threads(upload)
    assert all(isinstance(r, list) for r in results), results
    names = [a.name for a in registry.adapters.list("acme")]
    assert names == sorted(f"t{i}-{j}" for i in range(NUM_THREADS) for j in range(3))
    assert len({digest for r in results for digest in r}) == 3
    assert len(list(registry.blobs.digests())) == 4  # three weights blobs and one config blob
    assert list(registry.blobs.temp_dir.iterdir()) == []
    assert registry.reconcile().removed_blobs == ()


def test_racing_for_one_name_exactly_one_wins(registry: Registry, tmp_path: Path) -> None:
    folders = [write_adapter(tmp_path / f"a{i}", tensors=adapter_tensors(seed=10 + i))
               for i in range(NUM_THREADS)]
    results = _in_threads(lambda i: registry.adapters.upload_dir("acme", "contested",
                                                                 folders[i]))
    winners = [r for r in results if not isinstance(r, Exception)]
    assert len(winners) == 1, results
    assert all(isinstance(r, ConflictError) for r in results if r not in winners)
    (stored,) = registry.adapters.list()
    assert stored.digest == winners[0].digest
    assert sorted(registry.blobs.digests()) == sorted({stored.weights_sha256,
                                                       stored.config_sha256})
    assert list(registry.blobs.temp_dir.iterdir()) == []


def test_uploads_racing_deletes_of_the_same_bytes_keep_live_blobs(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every thread uploads and deletes adapters with the same bytes, so the blobs keep
    dropping to no references while other uploads of them are in flight; a stored adapter's
    blobs must never disappear."""
    folder = write_adapter(tmp_path / "a")
    publish = registry.blobs.publish

    def slow_publish(staged: Any) -> Path:
        path = publish(staged)
        time.sleep(0.01)  # widen the gap between a blob's rename and its row's commit
        return path

    monkeypatch.setattr(registry.blobs, "publish", slow_publish)

    def churn(thread: int) -> list[bool]:
        blobs_present = []
        for round_ in range(8):
            record = registry.adapters.upload_dir("acme", f"t{thread}-{round_}", folder)
            time.sleep(0.01)  # another thread's delete may be collecting garbage now
            blobs_present.append(record.weights_path.is_file() and record.config_path.is_file())
            if round_ < 7:
                registry.adapters.delete("acme", f"t{thread}-{round_}")
        return blobs_present

    assert _in_threads(churn) == [[True] * 8] * NUM_THREADS
    assert len(registry.adapters.list()) == NUM_THREADS
    assert registry.reconcile().is_consistent


def test_concurrent_key_checks_and_creation(registry: Registry) -> None:
    good = registry.keys.create(tenant="acme").secret
    revoked = registry.keys.create(tenant="acme")
    registry.keys.revoke(revoked.key.id)

    def check(thread: int) -> list[str]:
        outcomes = []
        for _ in range(15):
            outcomes.append(registry.keys.authenticate(good).tenant)
            for bad in (revoked.secret, good + "x"):
                try:
                    registry.keys.authenticate(bad)
                    outcomes.append("accepted")
                except AuthenticationError:
                    outcomes.append("refused")
        created = [registry.keys.create(tenant="acme").secret for _ in range(3)]
        return outcomes + [registry.keys.authenticate(s).tenant for s in created]

    results = _in_threads(check)
    for outcome in results:
        assert outcome == ["acme", "refused", "refused"] * 15 + ["acme"] * 3, outcome
    assert len(registry.keys.list()) == 2 + 3 * NUM_THREADS


def test_concurrent_usage_increments_lose_nothing(registry: Registry, tmp_path: Path) -> None:
    registry.adapters.upload_dir("acme", "sql", write_adapter(tmp_path / "a"))
    per_thread = 25

    def record(thread: int) -> None:
        for i in range(per_thread):
            registry.usage.record("acme", "sql" if i % 2 else None, prompt_tokens=3,
                                  completion_tokens=thread + 1)

    assert _in_threads(record) == [None] * NUM_THREADS
    rows = registry.usage.query(tenant="acme")
    total = NUM_THREADS * per_thread
    assert sum(r.num_requests for r in rows) == total
    assert sum(r.prompt_tokens for r in rows) == 3 * total
    assert sum(r.completion_tokens for r in rows) == per_thread * sum(range(1, NUM_THREADS + 1))
    served = registry.adapters.get("acme", "sql").num_requests_served
    assert served == NUM_THREADS * (per_thread // 2)

"""The content-addressed blob store on its own: digest-only paths with containment checks,
atomic publication, deduplication, stale temporary files."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loraplex.registry.blobs import BlobStore
from loraplex.registry.registry_errors import InvalidInputError


@pytest.fixture
def store(tmp_path: Path) -> BlobStore:
    blobs = BlobStore(tmp_path / "blobs")
    blobs.create_dirs()
    return blobs


@pytest.mark.parametrize("digest", ["", "ab", "A" * 64, "g" * 64, "../" + "a" * 61,
                                    "a" * 63 + "/", "a" * 65])
def test_paths_come_only_from_valid_digests(store: BlobStore, digest: str) -> None:
    with pytest.raises(InvalidInputError, match="not a sha256 digest"):
        store.path(digest)


def test_a_fanout_folder_linked_outside_the_store_is_refused(store: BlobStore,
                                                             tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (store.blob_dir / "ab").symlink_to(outside)
    with pytest.raises(InvalidInputError, match="escapes the blob store"):
        store.path("ab" + "0" * 62)


def test_stage_then_publish(store: BlobStore) -> None:
    data = os.urandom(3 * (1 << 20) + 5)  # several chunks
    staged = store.stage(io.BytesIO(data), max_bytes=len(data), what="weights")
    digest = hashlib.sha256(data).hexdigest()
    assert (staged.sha256, staged.size) == (digest, len(data))
    assert staged.path.parent == store.temp_dir and not store.exists(digest)
    final = store.publish(staged)
    assert final == store.blob_dir / digest[:2] / digest
    assert final.read_bytes() == data and not staged.path.exists()
    assert not final.stat().st_mode & stat.S_IWUSR  # blobs are immutable
    again = store.stage(data, max_bytes=len(data), what="weights")
    assert store.publish(again) == final and not again.path.exists()
    assert list(store.digests()) == [digest]
    assert store.verify(digest)
    assert store.remove(digest) and not store.remove(digest)
    assert list(store.digests()) == [] and not store.verify(digest)


def test_stage_past_the_limit_leaves_nothing(store: BlobStore, tmp_path: Path) -> None:
    source = tmp_path / "big"
    source.write_bytes(b"x" * 5000)
    with pytest.raises(InvalidInputError, match="weights is larger than the limit of 4096"):
        store.stage(source, max_bytes=4096, what="weights")
    assert list(store.temp_dir.iterdir()) == []


def test_verify_detects_corruption(store: BlobStore) -> None:
    final = store.publish(store.stage(b"hello", max_bytes=10, what="x"))
    final.chmod(0o644)
    final.write_bytes(b"hellO")
    assert not store.verify(final.name)


def test_stale_temp_files(store: BlobStore) -> None:
    mine = store.stage(b"in flight", max_bytes=100, what="x")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    host, _, rest = mine.path.name.partition(".")
    orphan = store.temp_dir / f"{host}.{dead.stdout.strip()}.{'0' * 16}.tmp"
    orphan.write_bytes(b"left by a dead process")
    old = store.temp_dir / f"otherhost.1.{'1' * 16}.tmp"
    old.write_bytes(b"old")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    fresh_elsewhere = store.temp_dir / f"otherhost.1.{'2' * 16}.tmp"
    fresh_elsewhere.write_bytes(b"another host's upload in flight")
    junk = store.temp_dir / "junk"
    junk.write_bytes(b"?")
    stale = set(store.stale_temps(max_age_s=600))
    assert stale == {orphan, old, junk}

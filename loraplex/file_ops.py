"""File helpers shared by the things built once into the data dir (the demos): an exclusive lock
between processes, and a folder built aside, flushed to disk and then renamed into place."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def build_in_place(root: Path, build: Callable[[Path], None], building_prefix: str,
                   retired_prefix: str) -> None:
    """Make `root` (a folder of its parent) anew: `build` fills a fresh temporary folder beside
    it (named `building_prefix`...), which is flushed to disk and renamed to `root`; the old
    `root` is renamed aside (`retired_prefix`...) and removed. A failed build leaves `root` as it
    was; leftovers of builds that died are removed first. The caller holds the lock."""
    parent = root.parent
    for leftover in [*parent.glob(building_prefix + "*"), *parent.glob(retired_prefix + "*")]:
        shutil.rmtree(leftover, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=building_prefix, dir=parent))
    try:
        build(staging)
        fsync_tree(staging)
        staging.chmod(0o755)  # mkdtemp made it private
        retired = None
        if root.exists():
            retired = parent / f"{retired_prefix}{uuid.uuid4().hex}"
            root.rename(retired)
        staging.rename(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def fsync_tree(folder: Path) -> None:
    """Flush the files of `folder` to disk, so that a crash after a rename leaves them whole."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as file:
                os.fsync(file.fileno())


@contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (released by the OS if the process dies)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps the build whole
        yield
        return
    with open(path, "a") as file:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(file.fileno(), fcntl.LOCK_UN)

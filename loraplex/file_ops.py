"""File helpers shared by the things built once into the data dir (the demos): an exclusive lock
between processes, and flushing a finished folder to disk before it is renamed into place."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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

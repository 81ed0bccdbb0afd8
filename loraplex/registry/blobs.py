"""Content-addressed blob store: `<root>/sha256/ab/<digest>`. A blob is streamed into a
temporary file under `<root>/tmp` (same file system) while it is hashed, fsynced, renamed onto
its sha256 name, and the directory fsynced; only then may a database row refer to it. Paths are
derived only from validated digests and checked to stay inside the store. A file system with no
space left is StorageFullError, and the partial file is removed."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from loraplex.registry.names import DIGEST_PATTERN, check_digest
from loraplex.registry.registry_errors import InvalidInputError, StorageFullError

CHUNK_BYTES = 1 << 20
_FANOUT = re.compile(r"[0-9a-f]{2}")
_TEMP = re.compile(r"(?P<host>[A-Za-z0-9-]{1,64})\.(?P<pid>\d+)\.[0-9a-f]{16}\.tmp")


@dataclass(frozen=True)
class StagedBlob:
    """A fully written, fsynced temporary file and the sha256 of its bytes."""

    path: Path
    sha256: str
    size: int


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.blob_dir = root / "sha256"
        self.temp_dir = root / "tmp"

    def create_dirs(self) -> None:
        for folder in (self.root, self.blob_dir, self.temp_dir):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)

    def path(self, digest: str) -> Path:
        """Where the blob with this sha256 lives (whether or not it exists)."""
        check_digest(digest)
        path = self.blob_dir / digest[:2] / digest
        if not path.resolve().is_relative_to(self.blob_dir.resolve()):
            raise InvalidInputError(f"blob path for {digest} escapes the blob store")
        return path

    def exists(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def stage(self, source: bytes | Path | BinaryIO, max_bytes: int, what: str) -> StagedBlob:
        """Copy `source` into a new temporary file, hashing as it streams. Raises
        InvalidInputError (and leaves nothing behind) past `max_bytes`."""
        path = self.temp_dir / _temp_name()
        hasher, size = hashlib.sha256(), 0
        try:
            with self._space_for(what), open(path, "xb") as out, \
                    contextlib.closing(_chunks(source)) as chunks:
                for chunk in chunks:
                    size += len(chunk)
                    if size > max_bytes:
                        raise InvalidInputError(f"{what} is larger than the limit of "
                                                f"{max_bytes} bytes")
                    hasher.update(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return StagedBlob(path, hasher.hexdigest(), size)

    def publish(self, staged: StagedBlob) -> Path:
        """Rename a staged file onto its sha256 name (durably). If the blob already exists the
        staged copy, holding the same bytes, is dropped."""
        final = self.path(staged.sha256)
        if final.is_file():
            staged.path.unlink(missing_ok=True)
            return final
        with self._space_for(f"blob {staged.sha256[:12]}"):
            if not final.parent.is_dir():
                final.parent.mkdir(mode=0o700, exist_ok=True)
                _fsync_dir(self.blob_dir)
            os.chmod(staged.path, 0o444)
            os.replace(staged.path, final)
            _fsync_dir(final.parent)
        return final

    @contextlib.contextmanager
    def _space_for(self, what: str) -> Iterator[None]:
        """ENOSPC and EDQUOT as StorageFullError naming the store and what did not fit."""
        try:
            yield
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise StorageFullError(f"no space left on the file system of the blob store ({self.root}): "
                                   f"{what} was not stored; free space there and retry") from exc

    def discard(self, staged: StagedBlob) -> None:
        staged.path.unlink(missing_ok=True)

    def remove(self, digest: str) -> bool:
        """Delete a blob; False if it was not there."""
        path = self.path(digest)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        _fsync_dir(path.parent)
        return True

    def digests(self) -> Iterator[str]:
        """Every blob in the store."""
        if not self.blob_dir.is_dir():
            return
        for fanout in sorted(self.blob_dir.iterdir()):
            if not (fanout.is_dir() and _FANOUT.fullmatch(fanout.name)):
                continue
            for entry in sorted(fanout.iterdir()):
                if DIGEST_PATTERN.fullmatch(entry.name) and entry.name[:2] == fanout.name:
                    yield entry.name

    def stale_temps(self, max_age_s: float) -> list[Path]:
        """Temporary files whose writer is gone: written by a process of this host that no
        longer runs (or whose pid a later process now has), older than `max_age_s`, or not
        named by this store at all."""
        if not self.temp_dir.is_dir():
            return []
        host, now, stale = _host_name(), time.time(), []
        for entry in self.temp_dir.iterdir():
            match = _TEMP.fullmatch(entry.name)
            with contextlib.suppress(FileNotFoundError):
                written_at = entry.stat().st_mtime
                if match is None or now - written_at > max_age_s or (
                    match["host"] == host and _is_writer_gone(int(match["pid"]), written_at)
                ):
                    stale.append(entry)
        return stale

    def verify(self, digest: str) -> bool:
        """Whether the blob exists and its bytes still hash to its name."""
        path, hasher = self.path(digest), hashlib.sha256()
        try:
            with open(path, "rb") as stream:
                while chunk := stream.read(CHUNK_BYTES):
                    hasher.update(chunk)
        except FileNotFoundError:
            return False
        return hasher.hexdigest() == digest


def _temp_name() -> str:
    return f"{_host_name()}.{os.getpid()}.{secrets.token_hex(8)}.tmp"


def _host_name() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"


def _is_writer_gone(pid: int, written_at: float) -> bool:
    """Whether the process `pid` that last wrote a file at `written_at` is gone: no process has
    that pid, or the one that has it started after the write. A server restarted in a container
    gets the pid its killed predecessor had (often 1), so a running pid proves nothing alone."""
    if not _is_running(pid):
        return True
    started_at = _start_time(pid)
    return started_at is not None and started_at > written_at


def _start_time(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch, to the clock tick), from Linux's
    /proc (its start is counted in ticks since boot); None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # Fields after the command name (which may hold spaces): state is field 3, starttime 22.
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        booted_at = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return booted_at + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _chunks(source: bytes | Path | BinaryIO) -> Iterator[bytes]:
    if isinstance(source, bytes):
        yield source
    elif isinstance(source, Path):
        with open(source, "rb") as stream:
            yield from _read_chunks(stream)
    else:
        yield from _read_chunks(source)


def _read_chunks(stream: BinaryIO) -> Iterator[bytes]:
    while chunk := stream.read(CHUNK_BYTES):
        yield chunk


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

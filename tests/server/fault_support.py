"""Real faults for the reliability tests: a PostgreSQL cluster of the test's own (on a free port,
started and stopped with pg_ctl; the shared server at 127.0.0.1:5432 is never stopped), an SQLite
database locked by another process, and a small tmpfs that fills up. Nothing here mocks a
failure: the server meets the database or the disk as they really fail."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from tests.server.server_support import free_socket

POSTGRES_USER = "postgres"
"""initdb refuses to run as root: the cluster runs as this system user."""
DEADLINE_S = 60.0
T = TypeVar("T")


def wait_for(condition: Callable[[], T | None], what: str, deadline_s: float = DEADLINE_S,
             interval_s: float = 0.05) -> T:
    """Poll until `condition` returns something truthy (returned); fail after `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval_s)


def postgres_bin() -> Path | None:
    folders = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    found = [folder for folder in folders if (folder / "pg_ctl").is_file()]
    if found:
        return found[0]
    pg_ctl = shutil.which("pg_ctl")
    return Path(pg_ctl).parent if pg_ctl else None


@dataclass
class PostgresCluster:
    """A PostgreSQL cluster in its own folder on its own port."""

    bin_dir: Path
    data_dir: Path
    port: int

    def _run(self, *args: str) -> None:
        command = [str(self.bin_dir / args[0]), *args[1:]]
        if os.geteuid() == 0:
            command = ["runuser", "-u", POSTGRES_USER, "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=DEADLINE_S)

    def start(self) -> None:
        self._run("pg_ctl", "start", "-w", "-D", str(self.data_dir), "-l", str(self.data_dir / "log"),
                  "-o", f"-p {self.port} -k {self.data_dir} -c listen_addresses=127.0.0.1 -c fsync=off")

    def stop(self) -> None:
        """A fast shutdown: the server ends every session and stops."""
        self._run("pg_ctl", "stop", "-w", "-m", "fast", "-D", str(self.data_dir))

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://{POSTGRES_USER}@127.0.0.1:{self.port}/{database}"

    def connect(self, database: str = "postgres"):  # noqa: ANN201 (psycopg is imported lazily)
        import psycopg

        return psycopg.connect(host="127.0.0.1", port=self.port, user=POSTGRES_USER, dbname=database,
                               autocommit=True, connect_timeout=5)

    def create_database(self, name: str) -> str:
        with self.connect() as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    @contextlib.contextmanager
    def hung(self, database: str | None = None) -> Iterator[None]:
        """The server stops answering new connections for the block (its postmaster is
        SIGSTOPped: the kernel still accepts them, nobody answers), as a server stuck or cut off
        by the network looks to a client. With `database`, the sessions open on it are ended
        once the postmaster is stopped (a session opened between ending them and stopping it,
        as a server's background sync does within a quarter second, would go on answering)."""
        pid = int((self.data_dir / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGSTOP)
        try:
            if database is not None:
                _end_sessions(pid, database)
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def kill_connections(self, database: str) -> int:
        """Terminate every session on `database` (as an operator or a failover would)."""
        with self.connect() as connection:
            rows = connection.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()", (database,)).fetchall()
        return len(rows)


def _end_sessions(postmaster: int, database: str) -> None:
    """SIGTERM (what pg_terminate_backend sends) the postmaster's backends whose process title
    names `database` (Linux: /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            title = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # (gone meanwhile)
        if parent == postmaster and f" {database} ".encode() in title:
            os.kill(int(entry.name), signal.SIGTERM)


@contextlib.contextmanager
def postgres_cluster() -> Iterator[PostgresCluster]:
    """initdb a cluster into a temporary folder and start it; stopped and removed at the end.
    Skips where no PostgreSQL server binaries are installed."""
    bin_dir = postgres_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL's server binaries (initdb, pg_ctl) are not installed")
    root = Path(tempfile.mkdtemp(prefix="loraplex-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, POSTGRES_USER)
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    cluster = PostgresCluster(bin_dir, root / "data", port)
    try:
        cluster._run("initdb", "-D", str(cluster.data_dir), "-A", "trust", "-U", POSTGRES_USER,
                     "--no-sync", "-E", "UTF8")
        cluster.start()
        yield cluster
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def sqlite_locked(path: Path) -> Iterator[None]:
    """Another process holds the write lock of the SQLite database at `path` (a write
    transaction left open, as a stuck CLI or a backup would) until the block ends: in WAL mode
    readers go on, writers wait out their busy timeout and fail."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sqlite3, sys\n"
        f"c = sqlite3.connect({str(path)!r}, timeout={DEADLINE_S}, isolation_level=None)\n"
        "c.execute('BEGIN IMMEDIATE')\n"
        "print('locked', flush=True)\n"
        "sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        yield
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(DEADLINE_S)


@contextlib.contextmanager
def small_tmpfs(size_bytes: int) -> Iterator[Path]:
    """A tmpfs of `size_bytes`, mounted for the block. Skips (saying why) only where mounting is
    impossible (not root, or no mount permission in this container)."""
    folder = Path(tempfile.mkdtemp(prefix="loraplex-tmpfs-"))
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs",
                             str(folder)], capture_output=True, text=True)
    if result.returncode != 0:
        folder.rmdir()
        pytest.skip(f"cannot mount a tmpfs for the full-disk test: {result.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
        folder.rmdir()


def fill(folder: Path) -> Path:
    """Write a file into `folder` until its file system has no space left; returns it."""
    path = folder / "filler"
    with open(path, "wb", buffering=0) as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * 65536)
    return path


class CommitCutter:
    """A TCP proxy in front of a PostgreSQL server that, once armed, cuts one connection at the
    worst moment: it passes on the COMMIT of a transaction that sent `marker`, waits for the
    server's answer (the transaction is then durable) and closes the connection instead of
    passing the answer back. The client is told that the connection was lost, not that its
    transaction committed: a network failure that a retry must not count twice."""

    _COMMIT = b"Q\x00\x00\x00\x0bCOMMIT\x00"  # the simple-protocol query `COMMIT`

    def __init__(self, port: int, marker: bytes) -> None:
        self._target = ("127.0.0.1", port)
        self._marker = marker
        self._listener = free_socket()
        self._listener.listen(16)
        self._is_armed = False
        self._lock = threading.Lock()
        self.num_cut = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    def arm(self) -> None:
        with self._lock:
            self._is_armed = True

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            state = {"wrote": False, "cutting": False}
            threading.Thread(target=self._to_server, args=(client, server, state), daemon=True).start()
            threading.Thread(target=self._to_client, args=(server, client, state), daemon=True).start()

    def _to_server(self, client: socket.socket, server: socket.socket, state: dict[str, bool]) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                state["wrote"] = state["wrote"] or self._marker in data
                if self._COMMIT in data:
                    with self._lock:
                        if self._is_armed and state["wrote"]:
                            self._is_armed, state["cutting"] = False, True
                    state["wrote"] = False
                server.sendall(data)
        _close(client, server)

    def _to_client(self, server: socket.socket, client: socket.socket, state: dict[str, bool]) -> None:
        with contextlib.suppress(OSError):
            while data := server.recv(65536):
                if state["cutting"]:  # the COMMIT's answer: committed, and never told
                    with self._lock:
                        self.num_cut += 1
                    break
                client.sendall(data)
        _close(client, server)


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()

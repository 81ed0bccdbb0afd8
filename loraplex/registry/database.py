"""Database engines and transactions. SQLite (WAL, busy timeout, synchronous=NORMAL, writes as
BEGIN IMMEDIATE so concurrent writers queue instead of failing on a lock upgrade) or PostgreSQL
through psycopg 3. No module-level engines: `make_engine(url)` builds one per registry.

A database that fails under a transaction (unreachable, a connection lost, locked past the busy
timeout) raises RegistryUnavailableError; one out of space raises StorageFullError. The pool
checks a connection before lending it (PostgreSQL), so a server that comes back is used again
without a restart."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from loraplex.registry.registry_errors import RegistryError, RegistryUnavailableError, StorageFullError

_BEGIN_OPTION = "loraplex_sqlite_begin"
# Key of the PostgreSQL advisory lock that serialises blob publication and garbage collection.
_BLOB_LOCK_KEY = 0x6C6F7261
_PG_DISK_FULL = "53100"
_SQLITE_FULL = 13


def make_engine(url: str, *, busy_timeout_s: float = 30.0, connect_timeout_s: float = 5.0) -> Engine:
    """An Engine for an SQLite or PostgreSQL URL (`postgresql://` means psycopg 3)."""
    parsed = parse_url(url)
    if parsed.get_backend_name() == "sqlite":
        return _make_sqlite_engine(parsed, busy_timeout_s)
    connect_args = {} if "connect_timeout" in parsed.query else {
        "connect_timeout": max(1, round(connect_timeout_s))}
    return create_engine(parsed, pool_pre_ping=True, connect_args=connect_args)


def parse_url(url: str) -> URL:
    """Parse and normalise a registry database URL, refusing backends other than SQLite and
    PostgreSQL."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise RegistryError(f"cannot parse database URL {url!r}") from None
    if parsed.drivername in ("postgres", "postgresql"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    backend = parsed.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise RegistryError(f"unsupported database {backend!r}: use sqlite:/// or postgresql://")
    return parsed


def display_url(url: str) -> str:
    """The URL with any password hidden, for messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparsable URL>"


def _make_sqlite_engine(url: URL, busy_timeout_s: float) -> Engine:
    engine = create_engine(url, connect_args={"timeout": busy_timeout_s})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take BEGIN away from the sqlite3 module; the "begin" hook below emits it.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        _use_wal(cursor, busy_timeout_s)
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        mode = connection.get_execution_options().get(_BEGIN_OPTION, "IMMEDIATE")
        connection.exec_driver_sql(f"BEGIN {mode}")

    return engine


def _use_wal(cursor: Any, timeout_s: float) -> None:
    """Put the database in WAL mode (once: the mode is stored in the file). Switching needs the
    database to itself, and SQLite answers "locked" at once, without waiting out busy_timeout,
    when another connection is opening it at the same moment (replicas starting on a new
    database): retry until the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if cursor.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class Database:
    """An engine and the two kinds of transaction the service layer opens: `write()` (on SQLite
    BEGIN IMMEDIATE, holding the one write lock from the start) and `read()` (plain BEGIN)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.is_sqlite = engine.dialect.name == "sqlite"
        reader = engine.execution_options(**{_BEGIN_OPTION: "DEFERRED"})
        self._writer_sessions = sessionmaker(engine, expire_on_commit=False)
        self._reader_sessions = sessionmaker(reader, expire_on_commit=False)

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A session inside a write transaction, committed on success."""
        with _database_errors(), self._writer_sessions() as session, session.begin():
            yield session

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A session inside a read transaction."""
        with _database_errors(), self._reader_sessions() as session, session.begin():
            yield session

    def lock_blobs(self, session: Session) -> None:
        """Serialise blob publication and deletion with every other writer, across processes,
        until this transaction ends: on SQLite the IMMEDIATE write lock, on PostgreSQL an
        advisory lock."""
        if self.is_sqlite:
            session.connection()
        else:
            session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _BLOB_LOCK_KEY})

    def dispose(self) -> None:
        self.engine.dispose()


@contextmanager
def _database_errors() -> Iterator[None]:
    """The driver's failures of the database itself as the registry's typed errors (a bad
    statement or a constraint stays what it is)."""
    try:
        yield
    except DBAPIError as exc:
        if _is_storage_full(exc):
            raise StorageFullError(f"the registry database has no space left: {_reason(exc)}") from exc
        if isinstance(exc, OperationalError) or exc.connection_invalidated:
            raise RegistryUnavailableError(f"the registry database is unavailable: {_reason(exc)}") from exc
        raise


def _is_storage_full(exc: DBAPIError) -> bool:
    original = exc.orig
    if isinstance(original, sqlite3.OperationalError):
        code = getattr(original, "sqlite_errorcode", None)  # Python 3.11+
        return code == _SQLITE_FULL if code is not None else "database or disk is full" in str(original)
    return getattr(original, "sqlstate", None) == _PG_DISK_FULL


def _reason(exc: DBAPIError) -> str:
    lines = str(exc.orig or exc).strip().splitlines()
    return lines[0] if lines else type(exc.orig or exc).__name__

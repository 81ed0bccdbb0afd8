"""Registry settings and the database engines: SQLite pragmas on every connection, writes as
BEGIN IMMEDIATE, URL handling."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import text

from loraplex.registry import RegistryConfig
from loraplex.registry.database import Database, make_engine, parse_url
from loraplex.registry.registry_errors import RegistryError


def test_flags_win_over_environment_over_defaults(tmp_path: Path) -> None:
    env = {"LORAPLEX_DATA_DIR": str(tmp_path / "env"), "LORAPLEX_DATABASE_URL": "sqlite:///e.db"}
    from_flags = RegistryConfig.resolve(tmp_path / "flag", "sqlite:///f.db", environ=env)
    assert from_flags.data_dir == tmp_path / "flag"
    assert from_flags.url == "sqlite:///f.db"
    from_env = RegistryConfig.resolve(environ=env)
    assert from_env.data_dir == tmp_path / "env"
    assert from_env.url == "sqlite:///e.db"
    default = RegistryConfig.resolve(environ={})
    assert default.data_dir == (Path.cwd() / "loraplex-data").resolve()
    assert default.url == f"sqlite:///{default.data_dir / 'registry.db'}"
    assert default.blob_dir == default.data_dir / "blobs"


def test_urls_are_normalised_and_other_backends_refused() -> None:
    assert parse_url("postgresql://u@h/db").drivername == "postgresql+psycopg"
    assert parse_url("postgres://u@h/db").drivername == "postgresql+psycopg"
    assert parse_url("sqlite:///x.db").drivername == "sqlite"
    with pytest.raises(RegistryError, match="unsupported database"):
        parse_url("mysql://u@h/db")
    with pytest.raises(RegistryError, match="cannot parse"):
        parse_url("not a url")


def test_sqlite_pragmas_are_set_on_every_connection(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'r.db'}", busy_timeout_s=7)
    try:
        for _ in range(2):
            with engine.connect() as connection:
                pragma = lambda name: connection.exec_driver_sql(f"PRAGMA {name}").scalar()
                assert pragma("journal_mode") == "wal"
                assert pragma("busy_timeout") == 7000
                assert pragma("synchronous") == 1  # NORMAL
                assert pragma("foreign_keys") == 1
            engine.dispose()  # the next round gets a brand-new connection
    finally:
        engine.dispose()


def test_sqlite_writes_take_the_write_lock_at_begin_and_reads_do_not(tmp_path: Path) -> None:
    path = tmp_path / "r.db"
    db = Database(make_engine(f"sqlite:///{path}", busy_timeout_s=5))
    other = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        with db.read() as session:
            session.execute(text("SELECT 1"))
            other.execute("BEGIN IMMEDIATE")  # a reader leaves the write lock free
            other.execute("ROLLBACK")
        with db.write() as session:
            session.execute(text("SELECT 1"))  # only a read, but the lock is already held
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
    finally:
        other.close()
        db.dispose()

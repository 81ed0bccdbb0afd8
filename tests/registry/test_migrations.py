"""Alembic migrations on SQLite and PostgreSQL: upgrade from empty, idempotence, downgrade to
base, agreement with the ORM tables, the append-only audit log."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.exc import DBAPIError

from loraplex.registry import Registry, RegistryConfig
from loraplex.registry.database import make_engine
from loraplex.registry.migrate import current_revision, downgrade, head_revision, upgrade
from loraplex.registry.registry_errors import RegistryError
from loraplex.registry.tables import Base

TABLES = {"tenants", "api_keys", "adapters", "system_prompts", "usage", "audit_log",
          "served_model", "rate_windows", "usage_writes", "documents"}


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_from_empty_then_downgrade_to_base_and_up_again(database_url: str) -> None:
    assert _tables(database_url) == set()
    assert upgrade(database_url) == head_revision()
    assert _tables(database_url) == TABLES
    assert upgrade(database_url) == head_revision()  # idempotent
    assert downgrade(database_url) is None
    assert _tables(database_url) == set()
    assert upgrade(database_url) == head_revision()
    assert _tables(database_url) == TABLES


def test_concurrent_upgrades_of_an_empty_database_agree(database_url: str) -> None:
    with ThreadPoolExecutor(3) as pool:
        revisions = list(pool.map(lambda _: upgrade(database_url), range(3)))
    assert revisions == [head_revision()] * 3
    assert _tables(database_url) == TABLES


def test_migrations_match_the_orm_tables(database_url: str) -> None:
    upgrade(database_url)
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()


def test_audit_log_refuses_update_and_delete(database_url: str) -> None:
    upgrade(database_url)
    engine = make_engine(database_url)
    try:
        with engine.begin() as connection:
            connection.execute(text(
                "INSERT INTO audit_log (action, object_type, object_id, details, created_at) "
                "VALUES ('x', 'y', 'z', '{}', '2024-01-01 00:00:00')"))
        for statement in ("UPDATE audit_log SET action = 'changed'", "DELETE FROM audit_log"):
            with pytest.raises(DBAPIError, match="append-only"), engine.begin() as connection:
                connection.execute(text(statement))
        with engine.connect() as connection:
            assert connection.execute(text("SELECT action FROM audit_log")).scalars().all() == ["x"]
    finally:
        engine.dispose()


def test_open_without_migrating_refuses_an_old_schema(registry_config: RegistryConfig) -> None:
    with pytest.raises(RegistryError, match="db upgrade"):
        Registry.open(registry_config, migrate=False)
    with Registry.open(registry_config) as registry:  # migrates
        assert registry.tenants.list() == ()
    with Registry.open(registry_config, migrate=False) as registry:
        assert registry.tenants.list() == ()


def test_a_schema_newer_than_the_code_is_refused(registry_config: RegistryConfig) -> None:
    upgrade(registry_config.url)
    engine = make_engine(registry_config.url)
    try:
        with engine.begin() as connection:
            connection.execute(text("UPDATE alembic_version SET version_num = 'f00d'"))
        assert current_revision(engine) == "f00d"
    finally:
        engine.dispose()
    with pytest.raises(RegistryError, match="does not know"):
        Registry.open(registry_config)

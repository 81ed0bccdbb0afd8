"""Schema migrations (Alembic scripts in the top-level migrations/ folder, installed as
loraplex.migrations). The Alembic Config is built here in code; no alembic.ini is needed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Connection, Engine, text

from loraplex import migrations
from loraplex.registry.database import make_engine
from loraplex.registry.registry_errors import RegistryError

# Key of the PostgreSQL advisory lock that keeps two processes from migrating at once.
_MIGRATION_LOCK_KEY = 0x6C6F7262


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RegistryError("the loraplex package ships no migrations")
    return head


def current_revision(engine: Engine) -> str | None:
    """The schema revision the database is at; None for an empty database."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def upgrade(url: str, revision: str = "head") -> str:
    """Migrate the database at `url` up to `revision`; idempotent. Returns the revision."""
    return _migrate(url, lambda config: command.upgrade(config, revision))


def downgrade(url: str, revision: str = "base") -> str | None:
    """Migrate the database at `url` down to `revision` ("base" drops every table)."""
    return _migrate(url, lambda config: command.downgrade(config, revision))


def ensure_schema(engine: Engine) -> None:
    """Upgrade to head unless the database is already there (a cheap read when it is)."""
    head, current = head_revision(), current_revision(engine)
    if current == head:
        return
    script = ScriptDirectory.from_config(alembic_config())
    known = {script_revision.revision for script_revision in script.walk_revisions()}
    if current is not None and current not in known:
        raise RegistryError(f"the registry database is at schema revision {current!r}, which "
                            f"this loraplex does not know (newer release?)")
    upgrade(engine.url.render_as_string(hide_password=False))


def _migrate(url: str, run: Callable[[Config], None]) -> str | None:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            _prepare(connection)
            with connection.begin():
                if connection.dialect.name == "postgresql":
                    connection.execute(text("SELECT pg_advisory_xact_lock(:key)"),
                                       {"key": _MIGRATION_LOCK_KEY})
                config = alembic_config()
                config.attributes["connection"] = connection
                try:
                    run(config)
                except CommandError as exc:
                    raise RegistryError(f"migration failed: {exc}") from None
        return current_revision(engine)
    finally:
        engine.dispose()


def _prepare(connection: Connection) -> None:
    if connection.dialect.name == "sqlite":
        # Batch migrations copy tables; cascading deletes must not fire while they do. The
        # pragma only works outside a transaction, so it goes straight to the driver.
        connection.connection.driver_connection.execute("PRAGMA foreign_keys=OFF")

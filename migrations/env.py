"""Alembic environment for the loraplex registry. loraplex.registry.migrate builds the Alembic
Config in code and hands over an open connection (config.attributes["connection"]) already in
a transaction; a URL in the config's sqlalchemy.url also works. SQLite runs in batch mode
(ALTER TABLE by copy)."""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from loraplex.registry.database import make_engine
from loraplex.registry.tables import Base


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(context.config.get_main_option("sqlalchemy.url"))
    try:
        with engine.begin() as connection:
            _run(connection)
    finally:
        engine.dispose()


def _run_offline() -> None:
    context.configure(
        url=context.config.get_main_option("sqlalchemy.url"),
        target_metadata=Base.metadata,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    _run_offline()
else:
    _run_online()

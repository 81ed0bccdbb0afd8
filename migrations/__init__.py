"""The registry's Alembic migrations (versions/), installed as loraplex.migrations. The
Alembic configuration is built in code (loraplex/registry/migrate.py); `loraplex db upgrade`
and every server start bring a database to the newest revision."""

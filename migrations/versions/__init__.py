"""Alembic revision scripts of the registry, oldest first (0001_initial, ...)."""

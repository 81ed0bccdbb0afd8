"""The adapter registry: tenants, API keys, adapters (content-addressed blobs), system prompts,
usage and the audit log, on SQLite or PostgreSQL. Never imports torch."""

from loraplex.registry.registry_config import RegistryConfig
from loraplex.registry.service import Registry

__all__ = ["Registry", "RegistryConfig"]

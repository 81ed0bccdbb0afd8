from tests.registry.registry_support import database_url, registry_config

__all__ = ["database_url", "registry_config"]

"""The HTTP server: the OpenAI-compatible API, the admin API, metrics and the admin UI, over
one engine and one registry. `create_app(ServerConfig(...), registry, engine)`."""

from loraplex.server.app import create_app
from loraplex.server.server_config import ServerConfig

__all__ = ["ServerConfig", "create_app"]

"""Registry exceptions. Each names the problem in its message and carries a stable `code`; the
server maps the classes to HTTP statuses (NotFoundError 404, ConflictError 409,
InvalidInputError 400, AuthenticationError 401, BaseModelUnknownError 409/503,
RegistryUnavailableError 503 with Retry-After, StorageFullError 507) and the CLI
prints the message as a one-line reason. Upload validation failures are
`loraplex.errors.AdapterError` (400)."""

from __future__ import annotations

from loraplex.errors import LoraplexError, UnknownAdapterError


class RegistryError(LoraplexError):
    """The registry cannot be used (database unreachable, schema newer than this code)."""

    code = "registry_error"


class RegistryUnavailableError(RegistryError):
    """The database cannot be reached now (stopped, restarting, a connection lost, SQLite locked
    past the busy timeout). Nothing was written; the same call may succeed shortly."""

    code = "registry_unavailable"
    retry_after_s = 1

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class StorageFullError(LoraplexError):
    """The data dir's file system (blobs) or the database has no space left. Nothing was
    stored; the same call succeeds once space is freed."""

    code = "insufficient_storage"


class NotFoundError(LoraplexError):
    """A tenant, key, adapter or system prompt does not exist."""

    code = "not_found"


class AdapterNotFoundError(NotFoundError, UnknownAdapterError):
    """A tenant has no adapter of that name (an OpenAI `model_not_found`)."""

    code = "model_not_found"


class ConflictError(LoraplexError):
    """The object already exists (a duplicate name) or the change clashes with current state."""

    code = "conflict"


class InvalidInputError(LoraplexError, ValueError):
    """A name, weight, limit or text given to the registry is not acceptable."""

    code = "invalid_input"


class AuthenticationError(LoraplexError):
    """An API key is unknown, malformed or revoked."""

    code = "invalid_api_key"


class BaseModelUnknownError(LoraplexError):
    """No served base model is recorded, so an upload cannot be checked against it."""

    code = "base_model_unknown"

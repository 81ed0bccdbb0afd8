"""Exceptions that cross layer boundaries. Each carries a stable `code` that the server maps to
an HTTP status and an OpenAI error body, and the CLI prints as a one-line reason."""

from __future__ import annotations


class LoraplexError(Exception):
    """Base class. `code` is a short machine-readable name, `param` the offending field."""

    code = "loraplex_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ModelLoadError(LoraplexError):
    """The base model folder cannot be served (missing file, unsupported architecture, pickle)."""

    code = "model_load_error"


class AdapterError(LoraplexError, ValueError):
    """An adapter is refused: bad format, unsupported feature, or shapes that do not fit."""

    code = "invalid_adapter"


class InvalidRequestError(LoraplexError, ValueError):
    """A request's parameters are invalid (bad sampling values, prompt too long, ...)."""

    code = "invalid_request"


class ContextLengthError(InvalidRequestError):
    """A prompt, or a prompt and max_tokens, longer than the model's context allows."""

    code = "context_length_exceeded"


class DeviceOutOfMemoryError(LoraplexError):
    """The device ran out of memory in a step that computed this request (the engine failed
    the step's largest request and serves on; the request may be retried)."""

    code = "out_of_device_memory"


class UnknownAdapterError(LoraplexError, KeyError):
    """A request names an adapter the engine does not know."""

    code = "model_not_found"

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return self.message

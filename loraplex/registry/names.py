"""Validation of the names and numbers that people give the registry."""

from __future__ import annotations

import re
from typing import Any

from loraplex.engine.tenants import check_weight as engine_check_weight
from loraplex.errors import InvalidRequestError
from loraplex.registry.registry_errors import InvalidInputError

NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
DIGEST_PATTERN = re.compile(r"[0-9a-f]{64}")


def check_name(value: Any, what: str) -> str:
    """A tenant, adapter or system prompt name: 1 to 64 of `A-Z a-z 0-9 . _ -`."""
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        raise InvalidInputError(
            f"invalid {what} name {value!r}: use 1 to 64 characters from A-Z, a-z, 0-9, '.', '_' "
            f"and '-'",
            param="name",
        )
    if value in (".", ".."):
        raise InvalidInputError(f"invalid {what} name {value!r}", param="name")
    return value


def check_text(value: str, what: str, param: str) -> str:
    """Text to store: valid Unicode (no lone surrogates, which neither database stores) and no
    NUL characters (which PostgreSQL refuses)."""
    if "\x00" in value:
        raise InvalidInputError(f"{what} holds a NUL character at {value.index(chr(0))}", param=param)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"{what} is not valid Unicode: it holds a lone surrogate at "
                                f"character {exc.start}", param=param) from None
    return value


def check_weight(value: Any) -> float:
    """A tenant's fair-share weight: a number from MIN_WEIGHT to MAX_WEIGHT (the engine's range)."""
    try:
        return engine_check_weight(value)
    except InvalidRequestError as error:
        raise InvalidInputError(str(error), param="weight") from None


def check_limit(value: Any, what: str) -> int | None:
    """A per-tenant limit: a positive integer, or None for unlimited."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < 2**31:
        raise InvalidInputError(f"{what} must be a positive integer or unset, got {value!r}",
                                param=what)
    return value


def check_digest(value: Any) -> str:
    """A lowercase hex sha256, the only thing blob paths are ever derived from."""
    if not isinstance(value, str) or not DIGEST_PATTERN.fullmatch(value):
        raise InvalidInputError(f"not a sha256 digest: {value!r}", param="digest")
    return value

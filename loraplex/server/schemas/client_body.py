"""The base of every JSON body a client sends: unknown fields are refused, and so is text that
is not valid Unicode, and nesting deeper than any body needs. JSON can carry a lone UTF-16
surrogate (`"\\ud800"`); Python decodes it into a `str` that no tokenizer, database driver or
JSON encoder accepts. The whole body is checked before its fields are (keys, nested values and
fields typed `Any` included), and refused with a 400 naming the field:
`messages.0.content.1.text`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

from loraplex.json_limits import path_deeper_than

INVALID_UNICODE = "invalid_unicode"
"""The pydantic error type (and the API's error code) of such text."""
NESTED_TOO_DEEP = "nested_too_deep"
MAX_DEPTH = 32
"""Arrays and objects in a body nest at most this deep (OpenAI's bodies need 4)."""


class ClientBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _refuse_bad_text_and_nesting(cls, data: Any) -> Any:
        deep = path_deeper_than(data, MAX_DEPTH)
        if deep is not None:
            raise PydanticCustomError(NESTED_TOO_DEEP, "{where} nests arrays and objects deeper than "
                                      "{limit} levels", {"path": deep, "where": ".".join(deep),
                                                         "limit": MAX_DEPTH})
        found = find_lone_surrogate(data)
        if found is not None:
            path, position, is_key = found
            where = ".".join(path) or "the body"
            raise PydanticCustomError(
                INVALID_UNICODE,
                "{where} is not valid Unicode: it holds a lone surrogate at character {position} "
                "(escapes \\ud800-\\udfff must come in high-low pairs)",
                {"path": path, "where": f"a key of {where}" if is_key else where, "position": position})
        return data


def find_lone_surrogate(value: Any) -> tuple[tuple[str, ...], int, bool] | None:
    """(path, character index, whether it is a key) of the first string in `value`, in
    document order, that holds a lone surrogate (a bad key gives its object's path), or None.
    Iterative, so any depth is fine."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            position = _surrogate_at(item)
            if position is not None:
                return path, position, False
        elif isinstance(item, dict):
            for key in item:
                position = _surrogate_at(key) if isinstance(key, str) else None
                if position is not None:
                    return path, position, True
            stack.extend(((*path, str(key)), child) for key, child in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend(((*path, str(i)), item[i]) for i in reversed(range(len(item))))
    return None


def _surrogate_at(text: str) -> int | None:
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None

"""JSON from outside (adapter configs, safetensors headers, model configs) parsed with its
nesting bounded. Python's parser recurses, and so does everything that later prints or walks
the result: a document nested thousands deep would end in a RecursionError rather than in a
message. Sizes are bounded by the callers, before parsing."""

from __future__ import annotations

import json
from typing import Any


class JSONTooDeepError(ValueError):
    """A JSON document nests arrays and objects deeper than allowed."""


def loads_bounded(raw: bytes | str, max_depth: int) -> Any:
    """json.loads, refusing (JSONTooDeepError) documents nested deeper than `max_depth`
    arrays and objects. Raises ValueError (json.JSONDecodeError, UnicodeDecodeError) for text
    that is not JSON."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise JSONTooDeepError(f"it is nested deeper than {max_depth} levels") from None
    if path_deeper_than(value, max_depth) is not None:
        raise JSONTooDeepError(f"it is nested deeper than {max_depth} levels")
    return value


def path_deeper_than(value: Any, max_depth: int) -> tuple[str, ...] | None:
    """The path (keys and indexes) of the first array or object in `value` that lies deeper
    than `max_depth` levels (`value` itself is level 1), or None. Iterative: any depth is
    fine."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, (dict, list)):
            if len(path) >= max_depth:
                return path
            items = item.items() if isinstance(item, dict) else enumerate(item)
            stack.extend(((*path, str(key)), child) for key, child in reversed(list(items))
                         if isinstance(child, (dict, list)))
    return None

"""The engine's options as command-line flags: one flag per field of loraplex.engine_config, named
as the field (`max_num_seqs` is `--max-num-seqs`, vLLM's name), its help the field's docstring
and its default the field's. A bad value is refused before anything loads, naming the flag."""

from __future__ import annotations

import argparse
import ast
import inspect
import typing
from dataclasses import MISSING, Field, fields
from functools import cache
from typing import Any

from loraplex.engine_config import SECTIONS, ConfigError, EngineConfig, option_owners
from loraplex.errors import LoraplexError

NOT_GIVEN = object()
"""Default of every engine flag: an option not given keeps the config's own default."""


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options", "How the engine runs (also the keyword "
                                      "arguments of the offline LLM(...)).")
    for name, (owner, spec) in _option_fields().items():
        default = spec.default if spec.default is not MISSING else spec.default_factory()
        help_text = _docstrings(owner).get(name, "").replace("%", "%%")  # argparse formats help with %
        if default is not None:
            help_text += f" (default: {default})"
        kwargs: dict[str, Any] = {"default": NOT_GIVEN, "help": help_text, "dest": name}
        hint = typing.get_type_hints(owner)[name]
        args = typing.get_args(hint)
        if hint is bool or set(args) == {bool, type(None)}:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(hint) is typing.Literal:
            kwargs["choices"] = args
        else:
            kwargs["type"] = next(a for a in args if a is not type(None)) if args else hint
            kwargs["metavar"] = kwargs["type"].__name__.upper()
        group.add_argument(flag(name), **kwargs)


def engine_config(model: str, args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the flags given (the rest keep their defaults)."""
    given = {name: getattr(args, name) for name in option_owners()
             if getattr(args, name, NOT_GIVEN) is not NOT_GIVEN}
    try:
        return EngineConfig.from_kwargs(model, **given)
    except ConfigError as exc:
        raise LoraplexError(f"{flag(exc.option)} {exc.message}") from None


def flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def _option_fields() -> dict[str, tuple[type, Field]]:
    """Each option -> (the dataclass that holds it, its field)."""
    found = {}
    for name, section in option_owners().items():
        owner = EngineConfig if section is None else SECTIONS[section]
        found[name] = owner, next(f for f in fields(owner) if f.name == name)
    return found


@cache
def _docstrings(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, joined into one line."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for field_node, doc_node in zip(body, body[1:]):
        if (isinstance(field_node, ast.AnnAssign) and isinstance(doc_node, ast.Expr)
                and isinstance(doc_node.value, ast.Constant) and isinstance(doc_node.value.value, str)):
            docs[field_node.target.id] = " ".join(doc_node.value.value.split())
    return docs

"""The `loraplex` command line: wiring only. Each command module adds its parser and a `run`
function; `main` parses, runs, and turns any error into a non-zero exit and one line on
stderr."""

from __future__ import annotations

import os
import sys
import traceback

from sqlalchemy.exc import SQLAlchemyError

from loraplex.benchmarks.cli import parse_args
from loraplex.cli import adapter, bench, db, document, key, model, prompt, serve, tenant
from loraplex.cli.common import ArgumentParser, add_registry_options
from loraplex.errors import LoraplexError

COMMANDS = (serve, model, db, tenant, key, adapter, prompt, document, bench)
DEBUG_ENV = "LORAPLEX_DEBUG"


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="loraplex", description="Serve many LoRA adapters to many "
                            "tenants from one GPU engine.")
    add_registry_options(parser, top_level=True)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    try:
        args.run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # every error becomes one line; LORAPLEX_DEBUG=1 shows more
        if os.environ.get(DEBUG_ENV):
            traceback.print_exc()
        print(f"loraplex: error: {describe(exc)}", file=sys.stderr)
        return 1
    return 0


def describe(exc: BaseException) -> str:
    """A one-line reason for an error."""
    if isinstance(exc, LoraplexError):
        message = exc.message
    elif isinstance(exc, SQLAlchemyError):
        message = f"database error: {getattr(exc, 'orig', None) or exc}"
    elif isinstance(exc, OSError):
        message = f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
    else:
        message = f"{type(exc).__name__}: {exc}"
    return " ".join(str(message).split())

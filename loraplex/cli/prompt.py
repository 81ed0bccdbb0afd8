"""`loraplex prompt add --tenant NAME --name NAME [--adapter ADAPTER] FILE` (FILE `-` reads
standard input)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loraplex.cli.common import add_registry_options, open_registry
from loraplex.registry.registry_errors import InvalidInputError


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("prompt", help="system prompts")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = actions.add_parser("add", help="add a named system prompt from a UTF-8 text file")
    add.add_argument("--tenant", required=True, metavar="NAME")
    add.add_argument("--name", required=True, metavar="NAME")
    add.add_argument("--adapter", metavar="ADAPTER", help="bind the prompt to this adapter")
    add.add_argument("file", metavar="FILE")
    add_registry_options(add)
    add.set_defaults(run=run_add)


def run_add(args: argparse.Namespace) -> None:
    text = read_text(args.file)
    with open_registry(args) as registry:
        prompt = registry.prompts.add(args.tenant, args.name, text, adapter=args.adapter)
    bound = f" (adapter {prompt.adapter})" if prompt.adapter else ""
    print(f"added system prompt {prompt.name} for tenant {prompt.tenant}{bound}: "
          f"{len(prompt.text)} characters")


def read_text(file: str) -> str:
    try:
        data = sys.stdin.buffer.read() if file == "-" else Path(file).read_bytes()
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInputError(f"{file} is not UTF-8 text") from None

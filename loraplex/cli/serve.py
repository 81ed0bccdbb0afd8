"""`loraplex serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--device auto|cpu|cuda]`."""

from __future__ import annotations

import argparse

from loraplex.cli.common import add_registry_options
from loraplex.errors import LoraplexError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("serve", help="run the OpenAI-compatible server")
    parser.add_argument("--model", metavar="DIR",
                        help="local Hugging Face model folder (default: the built-in demo)")
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"default {DEFAULT_HOST}")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    add_registry_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    """Start the server. `args` holds model, host, port, device, data_dir and database_url
    (resolve the registry settings with loraplex.cli.common.registry_config(args))."""
    raise LoraplexError("`loraplex serve` is not built yet")

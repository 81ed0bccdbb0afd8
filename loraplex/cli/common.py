"""What every command shares: the registry options, opening the registry, one-line errors and
plain-text tables."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any, NoReturn

from loraplex.registry import Registry, RegistryConfig
from loraplex.registry.registry_config import DATA_DIR_ENV, DATABASE_URL_ENV, DEFAULT_DATA_DIR


class ArgumentParser(argparse.ArgumentParser):
    """argparse with usage errors on one line."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def add_registry_options(parser: argparse.ArgumentParser, *, top_level: bool = False) -> None:
    """--data-dir and --database-url. Given on the top-level parser (default None) and on each
    command (default: leave the top-level value), so they work before or after the command."""
    default = None if top_level else argparse.SUPPRESS
    parser.add_argument(
        "--data-dir", default=default, metavar="DIR",
        help=f"blob store and default SQLite registry (${DATA_DIR_ENV}, default "
             f"{DEFAULT_DATA_DIR})",
    )
    parser.add_argument(
        "--database-url", default=default, metavar="URL",
        help=f"sqlite:///... or postgresql://... (${DATABASE_URL_ENV}, default SQLite in the "
             f"data dir)",
    )


def registry_config(args: argparse.Namespace) -> RegistryConfig:
    return RegistryConfig.resolve(data_dir=args.data_dir, database_url=args.database_url)


@contextmanager
def open_registry(args: argparse.Namespace) -> Iterator[Registry]:
    """The registry named by the options, migrated to the current schema if needed."""
    registry = Registry.open(registry_config(args))
    try:
        yield registry
    finally:
        registry.close()


def print_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Columns separated by two spaces, padded to the widest cell."""
    cells = [list(header)] + [[_cell(value) for value in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%SZ")
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value) or "-"
    return str(value)

"""`loraplex db upgrade`: migrate the registry schema to the current revision."""

from __future__ import annotations

import argparse

from loraplex.cli.common import add_registry_options, registry_config
from loraplex.registry.database import display_url
from loraplex.registry.migrate import upgrade


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("db", help="registry database schema")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    upgrade_parser = actions.add_parser("upgrade", help="migrate to the current schema")
    add_registry_options(upgrade_parser)
    upgrade_parser.set_defaults(run=run_upgrade)


def run_upgrade(args: argparse.Namespace) -> None:
    config = registry_config(args)
    config.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    revision = upgrade(config.url)
    print(f"registry schema at revision {revision} ({display_url(config.url)})")

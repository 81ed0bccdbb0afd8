"""`loraplex tenant create NAME [--weight W]`, `loraplex tenant list`."""

from __future__ import annotations

import argparse

from loraplex.cli.common import add_registry_options, open_registry, print_table


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("tenant", help="tenants")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="create a tenant")
    create.add_argument("name", metavar="NAME")
    create.add_argument("--weight", type=float, default=1.0,
                        help="share of the engine under contention (default 1)")
    add_registry_options(create)
    create.set_defaults(run=run_create)
    listing = actions.add_parser("list", help="list tenants")
    add_registry_options(listing)
    listing.set_defaults(run=run_list)


def run_create(args: argparse.Namespace) -> None:
    with open_registry(args) as registry:
        tenant = registry.tenants.create(args.name, weight=args.weight)
    print(f"created tenant {tenant.name} (weight {tenant.weight:g})")


def run_list(args: argparse.Namespace) -> None:
    with open_registry(args) as registry:
        tenants = registry.tenants.list()
    print_table(
        ("NAME", "WEIGHT", "MAX_CONCURRENT", "REQUESTS/MIN", "TOKENS/MIN", "CREATED"),
        [(t.name, t.weight, t.max_concurrent_requests, t.max_requests_per_minute,
          t.max_tokens_per_minute, t.created_at) for t in tenants],
    )

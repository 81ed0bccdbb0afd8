"""`loraplex key create --tenant NAME | --admin` (prints the key and nothing else),
`loraplex key list`, `loraplex key revoke KEY_ID`."""

from __future__ import annotations

import argparse

from loraplex.cli.common import add_registry_options, open_registry, print_table
from loraplex.registry.key_service import LAST_USED_RESOLUTION

LAST_USED_NOTE = (f"(LAST_USED is recorded at most once every {LAST_USED_RESOLUTION.seconds} s per key: "
                  f"it can be up to that much behind.)")


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("key", help="API keys")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="create a key; prints it once, on stdout")
    owner = create.add_mutually_exclusive_group(required=True)
    owner.add_argument("--tenant", metavar="NAME", help="a key of this tenant")
    owner.add_argument("--admin", action="store_true", help="an admin key")
    add_registry_options(create)
    create.set_defaults(run=run_create)
    listing = actions.add_parser("list", help="list keys (never their secrets)")
    add_registry_options(listing)
    listing.set_defaults(run=run_list)
    revoke = actions.add_parser("revoke", help="revoke a key")
    revoke.add_argument("key_id", metavar="KEY_ID", type=int)
    add_registry_options(revoke)
    revoke.set_defaults(run=run_revoke)


def run_create(args: argparse.Namespace) -> None:
    with open_registry(args) as registry:
        created = registry.keys.create(tenant=args.tenant, admin=args.admin)
    print(created.secret)


def run_list(args: argparse.Namespace) -> None:
    with open_registry(args) as registry:
        keys = registry.keys.list()
    print_table(
        ("ID", "ROLE", "TENANT", "PREFIX", "CREATED", "LAST_USED", "REVOKED"),
        [(k.id, k.role, k.tenant, k.prefix + "...", k.created_at, k.last_used_at, k.revoked_at)
         for k in keys],
    )
    print(LAST_USED_NOTE)


def run_revoke(args: argparse.Namespace) -> None:
    with open_registry(args) as registry:
        key = registry.keys.revoke(args.key_id)
    print(f"revoked key {key.id} ({key.prefix}...)")

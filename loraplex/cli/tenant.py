"""`loraplex tenant create NAME [--weight W]`, `loraplex tenant set NAME [--weight W] [limits]`,
`loraplex tenant list`. A running server takes a changed weight or limit from the registry
within its registry cache's time to live (`--registry-cache-ttl-s`), at once when the change is
made through its own admin API."""

from __future__ import annotations

import argparse

from loraplex.cli.common import add_registry_options, open_registry, print_table
from loraplex.errors import InvalidRequestError
from loraplex.registry.tenant_service import UNCHANGED


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("tenant", help="tenants")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="create a tenant")
    create.add_argument("name", metavar="NAME")
    create.add_argument("--weight", type=float, default=1.0,
                        help="share of the engine under contention (default 1)")
    add_registry_options(create)
    create.set_defaults(run=run_create)
    change = actions.add_parser("set", help="change a tenant's weight or limits")
    change.add_argument("name", metavar="NAME")
    change.add_argument("--weight", type=float, help="share of the engine under contention")
    for flag, meaning in LIMIT_FLAGS.items():
        change.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=_limit, metavar="N|none",
                            default=UNCHANGED,
                            help=f"{meaning} (none: unlimited)")
    add_registry_options(change)
    change.set_defaults(run=run_set)
    listing = actions.add_parser("list", help="list tenants")
    add_registry_options(listing)
    listing.set_defaults(run=run_list)


def run_create(args: argparse.Namespace) -> None:
    with open_registry(args) as registry:
        tenant = registry.tenants.create(args.name, weight=args.weight)
    print(f"created tenant {tenant.name} (weight {tenant.weight:g})")


def run_set(args: argparse.Namespace) -> None:
    changes = {flag: getattr(args, flag) for flag in LIMIT_FLAGS if getattr(args, flag) is not UNCHANGED}
    if args.weight is None and not changes:
        raise InvalidRequestError("tenant set: give --weight or a limit to change")
    with open_registry(args) as registry:
        tenant = registry.tenants.update(args.name, weight=UNCHANGED if args.weight is None else args.weight,
                                         **changes)
    limits = ", ".join(f"{flag} {getattr(tenant, flag) or 'unlimited'}" for flag in LIMIT_FLAGS)
    print(f"tenant {tenant.name}: weight {tenant.weight:g}, {limits}")


LIMIT_FLAGS = {
    "max_concurrent_requests": "requests at once",
    "max_requests_per_minute": "requests a minute",
    "max_tokens_per_minute": "prompt and generated tokens a minute",
}


def _limit(value: str) -> int | None:
    if value.lower() == "none":
        return None
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or none, not {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"a limit must be at least 1 (or none), not {number}")
    return number


def run_list(args: argparse.Namespace) -> None:
    with open_registry(args) as registry:
        tenants = registry.tenants.list()
    print_table(
        ("NAME", "WEIGHT", "MAX_CONCURRENT", "REQUESTS/MIN", "TOKENS/MIN", "CREATED"),
        [(t.name, t.weight, t.max_concurrent_requests, t.max_requests_per_minute,
          t.max_tokens_per_minute, t.created_at) for t in tenants],
    )

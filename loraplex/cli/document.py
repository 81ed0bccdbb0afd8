"""`loraplex document add TENANT NAME FILE` (FILE `-` reads standard input), `loraplex document
list [--tenant NAME]`, `loraplex document remove TENANT NAME`: a tenant's registered documents,
which requests include by name (`documents`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loraplex.cli.common import add_registry_options, open_registry, print_table
from loraplex.registry.document_service import MAX_DOCUMENT_CHARS
from loraplex.registry.registry_errors import InvalidInputError

MAX_FILE_BYTES = 4 * MAX_DOCUMENT_CHARS
"""A UTF-8 character takes at most 4 bytes: a larger file cannot fit."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("document", help="registered documents (reused KV, CacheBlend)")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = actions.add_parser("add", help="add a tenant's named document from a UTF-8 text file")
    add.add_argument("tenant", metavar="TENANT")
    add.add_argument("name", metavar="NAME")
    add.add_argument("file", metavar="FILE")
    add_registry_options(add)
    add.set_defaults(run=run_add)
    listing = actions.add_parser("list", help="list documents")
    listing.add_argument("--tenant", metavar="NAME", help="only this tenant's")
    add_registry_options(listing)
    listing.set_defaults(run=run_list)
    remove = actions.add_parser("remove", help="remove a tenant's document")
    remove.add_argument("tenant", metavar="TENANT")
    remove.add_argument("name", metavar="NAME")
    add_registry_options(remove)
    remove.set_defaults(run=run_remove)


def run_add(args: argparse.Namespace) -> None:
    text = read_document(args.file)
    with open_registry(args) as registry:
        document = registry.documents.add(args.tenant, args.name, text)
    print(f"added document {document.name} for tenant {document.tenant}: {len(document.text)} characters")


def run_list(args: argparse.Namespace) -> None:
    with open_registry(args) as registry:
        documents = registry.documents.list(args.tenant)
    print_table(("TENANT", "NAME", "CHARACTERS", "CREATED"),
                [(d.tenant, d.name, len(d.text), d.created_at) for d in documents])


def run_remove(args: argparse.Namespace) -> None:
    with open_registry(args) as registry:
        registry.documents.delete(args.tenant, args.name)
    print(f"removed document {args.name} of tenant {args.tenant}")


def read_document(file: str) -> str:
    """A document file's text: UTF-8, at most MAX_FILE_BYTES read (a larger one is refused)."""
    try:
        if file == "-":
            data = sys.stdin.buffer.read(MAX_FILE_BYTES + 1)
        else:
            with Path(file).open("rb") as handle:
                data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as error:
        raise InvalidInputError(f"cannot read {file}: {error.strerror or error}", param="file") from None
    if len(data) > MAX_FILE_BYTES:
        raise InvalidInputError(f"{file} is larger than {MAX_FILE_BYTES} bytes; a document holds at most "
                                f"{MAX_DOCUMENT_CHARS} characters", param="file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidInputError(f"{file} is not UTF-8 text (a binary file?): byte {error.start} "
                                "cannot be decoded", param="file") from None

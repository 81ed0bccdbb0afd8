"""The `loraplex` command line: wiring only."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    raise SystemExit("loraplex: the command line is not built yet")

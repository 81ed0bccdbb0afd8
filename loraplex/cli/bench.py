"""`loraplex bench ...`: wired from loraplex.benchmarks.cli."""

from loraplex.benchmarks.cli import add_parser

__all__ = ["add_parser"]

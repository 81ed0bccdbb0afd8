"""`python -m loraplex.benchmarks BENCHMARK ...` (the same as `loraplex bench`)."""

import argparse

from loraplex.benchmarks.cli import add_benchmarks

parser = argparse.ArgumentParser(prog="python -m loraplex.benchmarks")
add_benchmarks(parser)
args = parser.parse_args()
args.run(args)

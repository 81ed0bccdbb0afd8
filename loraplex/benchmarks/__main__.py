"""`python -m loraplex.benchmarks BENCHMARK ...` (the same as `loraplex bench`)."""

import argparse

from loraplex.benchmarks.cli import add_benchmarks, parse_args

parser = argparse.ArgumentParser(prog="python -m loraplex.benchmarks")
add_benchmarks(parser)
args = parse_args(parser)
args.run(args)

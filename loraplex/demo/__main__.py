"""`python -m loraplex.demo [DATA_DIR]`: build (or reuse) the demo and print the greedy answer of
the base model and of every demo adapter to the demo prompt, through transformers + PEFT."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from loraplex.demo.answers import greedy_answer, load_demo_model
from loraplex.demo.assets import ensure_demo
from loraplex.demo.corpus import DEMO_PROMPT
from loraplex.demo.demo_adapters import DEMO_ADAPTERS
from loraplex.registry.registry_config import DATA_DIR_ENV, DEFAULT_DATA_DIR, RegistryConfig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loraplex.demo", description=__doc__)
    parser.add_argument("data_dir", nargs="?", type=Path, default=None,
                        help=f"data folder (default: ${DATA_DIR_ENV} or {DEFAULT_DATA_DIR}, as for "
                             f"loraplex serve)")
    parser.add_argument("--prompt", default=DEMO_PROMPT, help="the user message to answer")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens per answer")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    start = time.perf_counter()
    assets = ensure_demo(RegistryConfig.resolve(data_dir=args.data_dir).data_dir)
    print(f"demo ready in {time.perf_counter() - start:.1f} s: {assets.model_dir.parent}")
    start = time.perf_counter()
    demo = load_demo_model(assets)
    print(f"loaded with transformers + PEFT in {time.perf_counter() - start:.1f} s")
    print(f"\nprompt: {args.prompt}\n")
    for adapter in [None, *DEMO_ADAPTERS]:
        name = "base" if adapter is None else adapter.name
        start = time.perf_counter()
        text = greedy_answer(demo, args.prompt, adapter and adapter.name, args.max_tokens)
        print(f"[{name}] ({time.perf_counter() - start:.2f} s) {text}")


if __name__ == "__main__":
    main()

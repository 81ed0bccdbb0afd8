"""`python -m loraplex.quickstart [DATA_DIR]`: build (or reuse) the quick start, then print each
adapter's accuracy on its task's held-out test set beside the base model's, and one reply of
each, through the engine in float32."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from loraplex.quickstart.assets import ensure_quickstart
from loraplex.quickstart.evaluate import evaluate
from loraplex.quickstart.tasks import make_tasks
from loraplex.registry.registry_config import DATA_DIR_ENV, DEFAULT_DATA_DIR, RegistryConfig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loraplex.quickstart", description=__doc__)
    parser.add_argument("data_dir", nargs="?", type=Path, default=None,
                        help=f"data folder (default: ${DATA_DIR_ENV} or {DEFAULT_DATA_DIR}, as for "
                             f"loraplex serve)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from loraplex import LLM

    start = time.perf_counter()
    assets = ensure_quickstart(RegistryConfig.resolve(data_dir=args.data_dir).data_dir)
    print(f"quick start ready in {time.perf_counter() - start:.1f} s")
    llm = LLM(assets.model_dir, device="cpu", dtype="float32", max_model_len=512)
    for name, folder in assets.adapters.items():
        llm.add_adapter(name, folder)
    tasks = make_tasks()
    start = time.perf_counter()
    scores = evaluate(llm, tasks)
    print(f"evaluated in {time.perf_counter() - start:.1f} s\n")
    for task, score in zip(tasks, scores):
        print(f"{task.name:10s} base {score.base_accuracy:6.1%}  adapter {score.adapter_accuracy:6.1%}  "
              f"({len(task.test)} held-out examples)")
        print(f"  prompt:  {task.test[0].prompt}\n  base:    {score.base_replies[0]!r}\n"
              f"  adapter: {score.adapter_replies[0]!r}")


if __name__ == "__main__":
    main()

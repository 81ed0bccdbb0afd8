"""What the quick start's lm-eval tasks (the YAML files beside this one) call: their documents,
made by `loraplex.quickstart.tasks.make_tasks` (the held-out test sets the adapters never saw),
and their score, each task's own `is_right` (the same as `python -m loraplex.quickstart`).

lm-eval loads this file by its path (`!function quickstart_tasks.NAME`), so it imports nothing
relative."""

from __future__ import annotations

import functools
from typing import Any

from loraplex.quickstart.tasks import Task, make_tasks


@functools.cache
def _tasks() -> dict[str, Task]:
    return {task.name: task for task in make_tasks()}


def load_test_set(task: str, **metadata: Any) -> dict[str, Any]:
    """`custom_dataset`: the test split of the quick-start task named `task` (the YAML's
    dataset_kwargs), a document a held-out example: its index, prompt (the user message) and
    right answer (empty for pirate, whose replies are scored by their words)."""
    import datasets

    docs = [{"task": task, "index": i, "prompt": ex.prompt, "answer": ex.answer}
            for i, ex in enumerate(_tasks()[task].test)]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


CHOICES = {"sentiment": ("positive", "negative")}
"""The labels of the tasks that are scored by likelihood as well (`*_choice.yaml`)."""


def load_choice_set(task: str, **metadata: Any) -> dict[str, Any]:
    """`custom_dataset` of a likelihood task: the test split of `task` with its labels
    (`choices`) and the index of the right one (`label`)."""
    import datasets

    choices = CHOICES[task]
    docs = [{"prompt": ex.prompt, "choices": list(choices), "label": choices.index(ex.answer)}
            for ex in _tasks()[task].test]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """acc: 1.0 when the reply is right by the task's own rule, else 0.0."""
    task = _tasks()[doc["task"]]
    return {"acc": float(task.is_right(results[0], task.test[doc["index"]]))}

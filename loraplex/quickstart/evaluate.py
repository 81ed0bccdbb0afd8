"""The quick start's adapters against the base model on each task's held-out test set, greedy,
through the engine: every test prompt once through the base model and once through its task's
adapter, all in one batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplex.quickstart.tasks import Task

MAX_REPLY_TOKENS = 48
"""Enough for every right reply (the longest, a JSON object, is about 20 tokens)."""


@dataclass(frozen=True)
class TaskScore:
    task: str
    base_accuracy: float
    adapter_accuracy: float
    base_replies: tuple[str, ...]
    adapter_replies: tuple[str, ...]


def evaluate(llm: Any, tasks: tuple[Task, ...]) -> list[TaskScore]:
    """Score the base model and each task's adapter (loaded into `llm`, a loraplex.LLM, under the
    task's name) on the task's test set."""
    from loraplex.quickstart.train import chat_prompt_ids
    from loraplex.types import SamplingParams

    prompts, adapters = [], []
    for task in tasks:
        ids = [chat_prompt_ids(llm.tokenizer, example.prompt) for example in task.test]
        prompts += ids + ids
        adapters += [None] * len(ids) + [task.name] * len(ids)
    outputs = llm.generate(prompt_token_ids=prompts, adapters=adapters,
                           sampling_params=SamplingParams(max_tokens=MAX_REPLY_TOKENS, temperature=0.0))
    replies = [output.text for output in outputs]
    scores, start = [], 0
    for task in tasks:
        count = len(task.test)
        base, tuned = replies[start:start + count], replies[start + count:start + 2 * count]
        scores.append(TaskScore(task.name, task.accuracy(base), task.accuracy(tuned), tuple(base),
                                tuple(tuned)))
        start += 2 * count
    return scores

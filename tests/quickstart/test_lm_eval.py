"""lm-evaluation-harness, unchanged, on the quick start through a real `loraplex serve`: the
project's own lm-eval tasks (loraplex/quickstart/lm_eval_tasks: each adapter's held-out test set,
scored by its task's rule) through `local-chat-completions` with the chat template, on the base
model and on each adapter. Each adapter beats the base model on its own task by a stated margin.
And by likelihood: the sentiment test set as a choice between its labels, through
`local-completions` (echo + logprobs on the completions API, the chat template applied by
lm-eval with the model's own tokenizer)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loraplex.quickstart import MODEL_ID
from loraplex.quickstart.evaluate import MAX_REPLY_TOKENS
from loraplex.quickstart.lm_eval_tasks import TASKS_DIR
from loraplex.quickstart.tasks import Task, make_tasks
from tests.quickstart.conftest import copy_quickstart
from tests.server.test_serve_cli import ServeProcess, loraplex_serve

MIN_MARGIN = 0.5
"""Each adapter's lm-eval accuracy on its own task exceeds the base model's by at least this."""
LIKELIHOOD_MIN_MARGIN = 0.3
"""The sentiment adapter's accuracy by likelihood over the base model's (measured: 1.0 against
0.5, the base model no better than a coin between the two labels)."""
NUM_CONCURRENT = 36
"""Requests lm-eval keeps in flight, batched by the server: a whole test set at once."""
TAG = "loraplex_quickstart"
"""The tag of the three tasks in the YAML files."""
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_quickstart(tmp_path_factory.mktemp("lm-eval") / "data")


@pytest.fixture(scope="module")
def served(data_dir: Path) -> Iterator[ServeProcess]:
    with loraplex_serve(data_dir) as running:
        yield running


@pytest.fixture(scope="module")
def task_manager() -> Any:
    """lm-eval's index of its own tasks and the project's folder, as `--include_path` gives it:
    built once (indexing lm-eval's bundled tasks takes seconds); each evaluation loads its tasks
    from it afresh."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR))


def _lm_eval(served: ServeProcess, task_manager: Any, model: str, tasks: list[str]) -> dict[str, Any]:
    import lm_eval

    return lm_eval.simple_evaluate(
        model="local-chat-completions", tasks=tasks, task_manager=task_manager,
        apply_chat_template=True, log_samples=True,
        model_args={"model": model, "base_url": f"{served.url}/v1/chat/completions",
                    "num_concurrent": NUM_CONCURRENT, "max_retries": 1})


def _accuracy(results: dict[str, Any], task: Task) -> float:
    """lm-eval's accuracy on `task`, after checking that it asked each held-out prompt once, in
    order, as one user message (the server applies the chat template), and that it scored the
    replies by the task's own rule."""
    name = f"loraplex_{task.name}"
    samples = sorted(results["samples"][name], key=lambda sample: sample["doc_id"])
    # arguments: [(context, generation kwargs)]; the context is lm-eval's JsonChatStr, a 1-tuple
    asked = [json.loads(sample["arguments"][0][0][0]) for sample in samples]
    assert asked == [[{"role": "user", "content": ex.prompt}] for ex in task.test]
    assert results["configs"][name]["generation_kwargs"]["max_gen_toks"] == MAX_REPLY_TOKENS
    accuracy = results["results"][name]["acc,none"]
    assert accuracy == pytest.approx(task.accuracy([sample["filtered_resps"][0] for sample in samples]))
    return accuracy


def test_each_adapter_beats_the_base_model_on_its_own_lm_eval_task(
        served: ServeProcess, task_manager: Any, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = (data_dir / "demo-api-key").read_text().strip()
    for name, value in (OFFLINE | {"OPENAI_API_KEY": key}).items():
        monkeypatch.setenv(name, value)
    tasks = make_tasks()
    started = time.monotonic()
    base = _lm_eval(served, task_manager, MODEL_ID, [TAG])
    assert sorted(base["results"]) == sorted(f"loraplex_{task.name}" for task in tasks)
    scores = {}  # task -> (base accuracy, adapter accuracy)
    for task in tasks:
        tuned = _lm_eval(served, task_manager, task.name, [f"loraplex_{task.name}"])
        scores[task.name] = (_accuracy(base, task), _accuracy(tuned, task))
    print(f"lm-eval through loraplex serve in {time.monotonic() - started:.0f} s, accuracy (base, adapter):",
          {name: (f"{b:.1%}", f"{a:.1%}") for name, (b, a) in scores.items()})
    for name, (base_accuracy, adapter_accuracy) in scores.items():
        assert adapter_accuracy >= base_accuracy + MIN_MARGIN, (name, scores)


def test_the_sentiment_adapter_beats_the_base_model_by_likelihood(
        served: ServeProcess, task_manager: Any, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lm_eval

    key = (data_dir / "demo-api-key").read_text().strip()
    for name, value in (OFFLINE | {"OPENAI_API_KEY": key}).items():
        monkeypatch.setenv(name, value)
    task = next(t for t in make_tasks() if t.name == "sentiment")
    model_dir = next((data_dir / "models").iterdir())
    scores = {}
    for model in (MODEL_ID, task.name):
        results = lm_eval.simple_evaluate(
            model="local-completions", tasks=["loraplex_sentiment_choice"],
            task_manager=task_manager, apply_chat_template=True, log_samples=True,
            model_args={"model": model, "base_url": f"{served.url}/v1/completions",
                        "num_concurrent": NUM_CONCURRENT, "max_retries": 1,
                        "tokenizer_backend": "huggingface", "tokenizer": str(model_dir)})
        samples = sorted(results["samples"]["loraplex_sentiment_choice"], key=lambda sample: sample["doc_id"])
        assert len(samples) == len(task.test)
        for sample, example in zip(samples, task.test):
            # Two requests a review, one a label, on the review in the chat template.
            (context, positive), (same_context, negative) = sample["arguments"]
            assert (positive, negative, same_context) == ("positive", "negative", context)
            assert example.prompt in context and context.rstrip().endswith("<|im_start|>assistant")
            assert sample["target"] == ("positive", "negative").index(example.answer)
            assert all(isinstance(logprob, float) and logprob < 0 for ((logprob, _),) in sample["resps"])
        scores[model] = results["results"]["loraplex_sentiment_choice"]["acc,none"]
    print("lm-eval by likelihood through loraplex serve, accuracy:", scores)
    assert scores[task.name] >= scores[MODEL_ID] + LIKELIHOOD_MIN_MARGIN, scores

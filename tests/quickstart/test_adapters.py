"""The quick start's adapters, trained with PEFT on SmolLM2-135M-Instruct, each beat the base
model on its own task's held-out test set, greedy, through the engine in float32; and they are
real PEFT adapters on the model the server serves."""

from __future__ import annotations

import json

import pytest

from loraplex import LLM
from loraplex.quickstart import MODEL_ID
from loraplex.quickstart.evaluate import evaluate
from loraplex.quickstart.tasks import make_tasks

MIN_MARGIN = 0.5
"""Each adapter's accuracy on its held-out set exceeds the base model's by at least this much."""
MIN_ACCURACY = 0.75
"""And is at least this."""


@pytest.fixture(scope="module")
def llm(quickstart):
    llm = LLM(quickstart.model_dir, device="cpu", dtype="float32", max_model_len=512, max_num_seqs=96)
    for name, folder in quickstart.adapters.items():
        llm.add_adapter(name, folder)
    return llm


def test_each_adapter_beats_the_base_model_on_its_held_out_set(llm):
    tasks = make_tasks()
    scores = {score.task: score for score in evaluate(llm, tasks)}
    report = {name: (score.base_accuracy, score.adapter_accuracy) for name, score in scores.items()}
    print(report)
    for task in tasks:
        score = scores[task.name]
        assert score.adapter_accuracy >= MIN_ACCURACY, (task.name, report, score.adapter_replies)
        assert score.adapter_accuracy >= score.base_accuracy + MIN_MARGIN, (task.name, report)
    # the held-out sets are held out: no test prompt was trained on
    for task in tasks:
        assert not {ex.prompt for ex in task.test} & {ex.prompt for ex in task.train}, task.name


def test_the_adapters_are_peft_folders_on_the_served_model(quickstart):
    assert quickstart.model_id == MODEL_ID
    config = json.loads((quickstart.model_dir / "config.json").read_text())
    assert config["_name_or_path"] == MODEL_ID and config["num_hidden_layers"] == 30
    assert list(quickstart.adapters) == ["pirate", "extract", "sentiment"]
    for folder in quickstart.adapters.values():
        adapter_config = json.loads((folder / "adapter_config.json").read_text())
        assert adapter_config["peft_type"] == "LORA" and adapter_config["r"] == 8
        assert (folder / "adapter_model.safetensors").stat().st_size > 0


def test_a_second_start_reuses_the_adapters(quickstart):
    from tests.quickstart.conftest import cached_quickstart

    before = {name: (folder / "adapter_model.safetensors").stat().st_mtime_ns
              for name, folder in quickstart.adapters.items()}
    again = cached_quickstart()
    assert again == quickstart
    assert {name: (folder / "adapter_model.safetensors").stat().st_mtime_ns
            for name, folder in again.adapters.items()} == before

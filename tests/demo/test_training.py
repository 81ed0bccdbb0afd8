"""Training is reproducible (the same weights from the same recipe, on the same machine) and
leaves the caller's torch RNG and thread count as they were."""

from __future__ import annotations

import dataclasses

import torch
from transformers import AutoTokenizer

import loraplex.demo.build
from loraplex.demo.train import TRAIN


def test_base_training_is_reproducible(demo_assets, monkeypatch):
    monkeypatch.setattr(loraplex.demo.build, "TRAIN", dataclasses.replace(TRAIN, base_epochs=1))
    tokenizer = AutoTokenizer.from_pretrained(demo_assets.model_dir)
    threads = torch.get_num_threads()
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    first = loraplex.demo.build._train_base(tokenizer).state_dict()
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.get_num_threads() == threads
    second = loraplex.demo.build._train_base(tokenizer).state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)

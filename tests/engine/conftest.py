from __future__ import annotations

import pytest

from tests.factories import ADAPTERS, make_adapter, make_hf_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama with a byte-level tokenizer and the test adapters:
    (model folder, {adapter name: folder})."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf = make_hf_model("llama", folder / "model")
    adapters = {spec.name: make_adapter(hf, spec, folder / "adapters", seed=i + 1)
                for i, spec in enumerate(ADAPTERS)}
    return folder / "model", adapters

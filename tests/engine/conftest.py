from __future__ import annotations

import pytest

from tests.factories import make_adapters, make_hf_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama with a byte-level tokenizer and the test adapters:
    (model folder, {adapter name: folder})."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf = make_hf_model("llama", folder / "model")
    adapters = make_adapters(hf, folder / "adapters")
    return folder / "model", adapters

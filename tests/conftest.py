"""Suite-wide pytest setup. Without CUDA, GPU tests skip, and the Triton kernels run through
the Triton interpreter: TRITON_INTERPRET must be set before any kernel module is imported
(triton reads it when a kernel is decorated), so it is set here, when the suite starts."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

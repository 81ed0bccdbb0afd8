from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from loraplex.worker.workers import TensorParallelWorkers


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Tiny models on a shared CPU: one thread is 20x faster than two contended ones (a
    single-process step fell from 0.37 s to 0.02 s); the workers run one thread each too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="session")
def tp2_workers():
    """Two CPU worker processes in one gloo group, shared by the tests (spawning them costs
    seconds); each test loads its own model into them. Stopped at the end of the session, or
    at once when a command fails."""
    with TensorParallelWorkers(2, timeout_s=120) as workers:
        yield workers

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
def _tp2_pool():
    pool: list[TensorParallelWorkers] = []
    yield pool
    for workers in pool:
        workers.close()


@pytest.fixture
def tp2_workers(_tp2_pool):
    """Two CPU worker processes in one gloo group, shared by the tests (spawning them costs
    seconds), started again after a test that made them stop; each test loads its own model."""
    if not _tp2_pool or _tp2_pool[-1].is_closed:
        _tp2_pool.append(TensorParallelWorkers(2, timeout_s=120))
    return _tp2_pool[-1]

from __future__ import annotations

import pytest

from loraplex.worker.workers import TensorParallelWorkers
from tests.parallel.tp_support import one_torch_thread


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

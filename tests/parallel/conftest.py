from __future__ import annotations

import pytest

from loraplex.worker.workers import TensorParallelWorkers
from tests.factories import ADAPTERS, make_adapter, make_dora_adapter, make_flora_adapter, make_ia3_adapter
from tests.parallel.tp_support import ARCHS, make_tiny_model, one_torch_thread


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


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny(request, tmp_path_factory):
    """(arch, model folder, {adapter name: folder})."""
    arch = request.param
    folder = tmp_path_factory.mktemp(f"tp-{arch}")
    with one_torch_thread():
        hf = make_tiny_model(arch, folder / "model", **ARCHS[arch])
        adapters = {spec.name: make_adapter(hf, spec, folder, seed=i)
                    for i, spec in enumerate(ADAPTERS[1:4:2], 1)}  # all8 (all seven), pattern
        adapters["dora"] = make_dora_adapter(hf, folder / "dora", ("q_proj", "v_proj", "o_proj", "down_proj"),
                                             rank=4, alpha=8)
        adapters["ia3"] = make_ia3_adapter(hf, folder / "ia3", ("k_proj", "v_proj", "o_proj", "down_proj"),
                                           ("down_proj",))
        adapters["flora"] = make_flora_adapter(hf, folder / "flora",
                                               ("q_proj", "o_proj", "up_proj", "down_proj"), rank=2)
    return arch, folder / "model", adapters


@pytest.fixture
def reuse_tp2_workers(tp2_workers, monkeypatch):
    """`LLM(..., tensor_parallel_size=2)` takes the shared worker processes instead of spawning
    its own (about 10 s a pair on the shared two cores) and leaves them running when it closes.
    The server test spawns its own."""
    from loraplex.worker import executor

    def shared(world_size: int, **options):
        assert world_size == tp2_workers.world_size and options.get("backend", "gloo") == "gloo"
        return tp2_workers

    monkeypatch.setattr(executor, "TensorParallelWorkers", shared)
    monkeypatch.setattr(executor.TensorParallelExecutor, "close", lambda self: None)
    return tp2_workers

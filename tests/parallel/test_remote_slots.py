"""The driver's side of a worker's adapter slots (loraplex/worker/executor.py RemoteSlots): with
one rank, adapters are laid out as its pool's pages on the driver, once, in shared memory, and a
load sends those pages without A and B (the rank's load reads neither); DoRA's go whole (its row
norms read them), and with more ranks each rank packs its own shard. Token-exactness through
the workers is test_disaggregated's and test_engine_tp's."""

import pickle
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import torch

from loraplex.engine.sizing import kv_block_bytes
from loraplex.worker.adapters import Inline
from loraplex.worker.executor import RemoteSlots
from tests.parallel.test_sharding import _host, config


def _slots(world_size: int, sent: list) -> RemoteSlots:
    c = config()
    workers = SimpleNamespace(world_size=world_size,
                              queue_adapter=lambda slot, adapter, pages: sent.append(adapter))
    return RemoteSlots(workers, 2, c, torch.float32, kv_block_bytes(c, 16, torch.float32), max_rank=2)


def test_one_rank_is_sent_packed_pages_without_a_and_b():
    sent = []
    slots = _slots(1, sent)
    lora, dora = _host(config(), "lora"), _host(config(), "dora")
    for slot, host in enumerate((lora, dora), start=1):
        slots.prepare(host)
        slots.load(slot, host, list(range(slots.pages_for(host))))
    slots.send_queued()
    light, whole = sent
    assert light.a == {} and light.b == {} and light.digest == lora.digest
    assert all(isinstance(t, Inline) for t in light.ranks.values())  # small tensors go by value
    ((key, packed),) = light.packed.items()
    assert packed.pages is lora.packed[key].pages and packed.pages.is_shared()
    assert whole is dora and all(p.pages.is_shared() for p in dora.packed.values())
    # Through the pipe's pickler: the pages cross as a handle, the rest as plain tensors.
    data = ForkingPickler.dumps(light)
    assert len(data) < packed.pages.numel()
    received = pickle.loads(data)
    assert received.family == "lora" and received.rank == lora.rank
    for group, ranks in lora.ranks.items():
        assert type(received.ranks[group]) is torch.Tensor and torch.equal(received.ranks[group], ranks)
    ((_, got),) = received.packed.items()
    assert torch.equal(got.pages, packed.pages)
    for entry, (page, start) in lora.packed[key].tables.items():
        assert torch.equal(got.tables[entry][0], page) and torch.equal(got.tables[entry][1], start)


def test_inline_tensors_round_trip_every_dtype_and_shape():
    for t in (torch.arange(6, dtype=torch.int32).reshape(2, 3), torch.randn(3, 1, 2).to(torch.bfloat16),
              torch.tensor(2.5), torch.zeros(0, 4, dtype=torch.int64), torch.randn(4, 6)[:, ::2]):
        back = pickle.loads(ForkingPickler.dumps(Inline(t)))
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)


def test_with_more_ranks_each_packs_its_own_shard():
    sent = []
    slots = _slots(2, sent)
    host = _host(config(), "lora")
    slots.prepare(host)
    slots.load(1, host, [0])
    slots.send_queued()
    assert host.packed == {} and sent == [host]

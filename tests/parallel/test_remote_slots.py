"""The driver's side of a worker's adapter slots (loraplex/worker/executor.py RemoteSlots): with
one rank, adapters are laid out as its pool's pages on the driver, once, in shared memory, and a
load sends those pages without A and B (the rank's load reads neither); DoRA's go whole (its row
norms read them), and with more ranks each rank packs its own shard. Token-exactness through
the workers is test_disaggregated's and test_engine_tp's."""

from types import SimpleNamespace

import torch

from loraplex.engine.sizing import kv_block_bytes
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
    assert light.a == {} and light.b == {} and light.ranks is lora.ranks and light.digest == lora.digest
    ((key, packed),) = light.packed.items()
    assert packed is lora.packed[key] and packed.pages.is_shared()
    assert whole is dora and all(p.pages.is_shared() for p in dora.packed.values())


def test_with_more_ranks_each_packs_its_own_shard():
    sent = []
    slots = _slots(2, sent)
    host = _host(config(), "lora")
    slots.prepare(host)
    slots.load(1, host, [0])
    slots.send_queued()
    assert host.packed == {} and sent == [host]

"""The driver's side of a worker's adapter slots (loraplex/worker/executor.py RemoteSlots): with
one rank, adapters are laid out as its pool's pages on the driver, once, in shared memory, and a
load sends those pages without A and B (the rank's load reads neither); DoRA's go whole (its row
norms read them), and with more ranks each rank packs its own shard. Token-exactness through
the workers is test_disaggregated's and test_engine_tp's."""

import pickle
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import pytest
import torch

from loraplex.engine.lora_weights import LoraSlotBuffers
from loraplex.engine.sizing import kv_block_bytes
from loraplex.worker.adapters import Inline, packed_for_the_wire
from loraplex.worker.executor import RemoteSlots
from loraplex.worker.process import Worker
from tests.parallel.test_sharding import _host, config


def _slots(world_size: int, sent: list) -> RemoteSlots:
    c = config()
    workers = SimpleNamespace(world_size=world_size,
                              queue_adapter=lambda slot, adapter, pages: sent.append(adapter))
    return RemoteSlots(workers, 2, c, torch.float32, kv_block_bytes(c, 16, torch.float32), max_rank=2)


class _RingWorkers:
    """A one-rank worker's driver side that records what it is sent."""

    world_size = 1

    def __init__(self) -> None:
        self.ring, self.loads = None, []

    def map_adapter_ring(self, ring):
        self.ring = ring

    def queue_adapter(self, slot, adapter, pages, ring=None, on_done=None):
        self.loads.append(SimpleNamespace(slot=slot, adapter=adapter, pages=pages, ring=ring,
                                          on_done=on_done))


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


def test_one_rank_loads_go_through_the_adapter_ring_while_it_has_room():
    c, workers = config(), _RingWorkers()
    block_bytes = kv_block_bytes(c, 16, torch.float32)
    probe = RemoteSlots(SimpleNamespace(world_size=1), 2, c, torch.float32, block_bytes, max_rank=2)
    adapter_bytes = probe.pages_for(_host(c, "lora")) * probe.page_bytes
    slots = RemoteSlots(workers, 4, c, torch.float32, block_bytes, max_rank=2,
                        ring_bytes=2 * adapter_bytes + 1)
    assert workers.ring is slots._ring and workers.ring.is_shared()
    assert slots.ring_free_bytes == 2 * adapter_bytes
    hosts = [_host(c, "lora") for _ in range(3)] + [_host(c, "dora")]
    for slot, host in enumerate(hosts, start=1):
        slots.prepare(host)
        slots.load(slot, host, [0])
    assert slots.ring_free_bytes == 0  # two adapters wrote their pages; the third found no room
    slots.send_queued()
    first, second, third, dora = workers.loads
    for load, host in ((first, hosts[0]), (second, hosts[1])):
        at, size = load.ring
        (packed,) = host.packed.values()
        assert size == adapter_bytes and torch.equal(workers.ring[at:at + size], packed.pages)
        ((_, sent),) = load.adapter.packed.items()
        assert sent.pages.numel() == 0 and load.adapter.a == {}  # neither pages nor A and B cross
    assert first.ring != second.ring
    assert third.ring is None and next(iter(third.adapter.packed.values())).pages.numel()
    assert dora.ring is None and dora.adapter is hosts[3]  # (whole: its row norms read A and B)
    assert slots.num_ring_loads == 2
    first.on_done(None)  # the worker answered: its copy out of the ring is done
    assert slots.ring_free_bytes == adapter_bytes
    slots.load(1, hosts[2], [0])
    slots.send_queued()
    assert workers.loads[-1].ring == first.ring  # the room it left
    second.on_done(None)
    workers.loads[-1].on_done(None)
    assert slots.ring_free_bytes == 2 * adapter_bytes


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_worker_loads_the_same_adapter_from_the_ring_as_from_its_pages(device):
    """The worker's side: pages from the adapter ring (pinned where they lie, on a GPU) land in
    the pool as pages sent whole do; an offset past the ring, or pages packed for another
    layout, are refused."""
    c = config()
    buffers = LoraSlotBuffers(c, 2, 2, torch.float32, torch.device(device))
    worker = Worker(SimpleNamespace(rank=0, world_size=1), torch.device(device))
    worker.layout = SimpleNamespace(world_size=1)
    worker.runner = SimpleNamespace(lora=buffers)
    host = _host(c, "lora")
    packed = buffers.prepare(host)
    ring = torch.zeros(packed.pages.numel() + 3 * buffers.page_bytes, dtype=torch.uint8)
    at = 2 * buffers.page_bytes
    ring[at:at + packed.pages.numel()] = packed.pages.cpu()
    worker.map_adapter_ring(ring.share_memory_())
    assert worker._ring_pinned == (device == "cuda")

    def through_the_pipe():
        sent = packed_for_the_wire(host, buffers.pack_key, pages_in_ring=True)
        return pickle.loads(ForkingPickler.dumps(sent))

    wire = through_the_pipe()
    pages = buffers.own_pages_of(2, buffers.pages_for(host))
    worker.load_adapter(2, wire, tuple(pages), ring=(at, packed.pages.numel()))
    from_ring = buffers.pool.clone()
    buffers.pool.zero_()
    buffers.load(2, host, list(pages))
    assert torch.equal(from_ring, buffers.pool) and from_ring.any()
    with pytest.raises(ValueError, match="of an adapter ring of"):
        worker.load_adapter(2, wire, tuple(pages), ring=(ring.numel() - 4, len(packed.pages)))
    other = through_the_pipe()
    other.packed = {("another layout",): next(iter(other.packed.values()))}
    with pytest.raises(ValueError, match="another layout"):
        worker.load_adapter(2, other, tuple(pages), ring=(at, packed.pages.numel()))
    worker.map_adapter_ring(torch.zeros(0, dtype=torch.uint8))  # a new ring: the old one unpinned
    assert not worker._ring_pinned

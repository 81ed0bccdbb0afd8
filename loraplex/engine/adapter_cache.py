"""The engine's adapters in two tiers: device slots (the slot buffers the LoRA kernels read, in
pages of the memory pool that the KV cache shares) and a host tier bounded in bytes (pinned on
CUDA), least recently used first. Adapters arrive by
digest from a loader that the caller supplies (the server's reads the blob store, the offline
API's reads folders).

Nothing here blocks a step. A host load (the loader's disk read and validation, then the
layout of the pool's pages, pinned on CUDA: `buffers.prepare`) runs on one of LOAD_THREADS
worker threads; a copy into a device slot runs on a side stream on CUDA, after
every step already launched (those may still read the slot's previous adapter), or on a second
worker thread on CPU. A request whose adapter is not on the device yet stays in the queue and
holds no running place; `acquire` starts what its adapter needs and says when it can run.

Device residency: an adapter takes a free slot (a row of the page tables) and as many pool
pages as its own rank and modules need (`buffers.pages_for`: a rank-8 adapter half of a rank-16
one), any pages, the lowest free ones, lent by the block manager, which hands KV blocks out from
the top down (cached prefix blocks lent are evicted). A new adapter is copied in while fewer
than `max_resident` adapters are resident and the pool has its pages free; else idle adapters
are evicted for it. Idle adapters stay
resident while memory is free, and give their blocks back when the KV cache runs short
(`reclaim`, before the scheduler preempts anyone). Either way the idle adapter evicted is the
one of lowest score (Chameleon's: 0.45 x its uses since it was loaded + 0.10 x recency + 0.45 x
its size, each over the largest among the idle), those that a queued request needs last.

Invariants: the host tier never holds more than `max_host_bytes` (a load reserves the bytes of
an adapter of the largest rank before it starts); an adapter that a queued or running request
needs is never dropped from the host tier, and a slot that a running request holds, or that is
being filled, is never evicted. Pure bookkeeping, but for the copies."""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from loraplex.adapter_format import LoraAdapter
from loraplex.engine.block_manager import BlockManager
from loraplex.engine.lora_weights import HostAdapter, LoraSlotBuffers

logger = logging.getLogger(__name__)

AdapterLoader = Callable[[str], "LoraAdapter | HostAdapter"]
"""digest -> the adapter's tensors (validated, with that digest). Runs on a worker thread."""

LOAD_THREADS = 2
"""Host loads at once: a load is mostly copies without the GIL (file reads, the page layout), and
a burst of requests for adapters not in host memory (a serving run's first seconds) waits on
them."""


class Wait(enum.Enum):
    """Why `acquire` gave no slot."""

    LOADING = "loading"
    """A host load or a slot copy is under way (or about to start): try again next step."""
    NO_HOST_ROOM = "no-host-room"
    """Every byte of the host tier holds an adapter that a request needs."""
    NO_SLOT = "no-slot"
    """No slot: the KV cache holds the free pages, every resident adapter is in use (held by
    running requests or being filled), or `max_resident` adapters are."""


@dataclass(eq=False)
class _HostEntry:
    digest: str
    reserved: int
    """Bytes counted against the bound: the largest adapter's while loading, then its own."""
    adapter: HostAdapter | None = None
    loading: Future | None = None
    num_copies: int = 0
    """Slot copies reading this entry's memory (it stays until they are done)."""


@dataclass(eq=False)
class _SlotCopy:
    digest: str
    entry: _HostEntry
    done: torch.cuda.Event | Future


class AdapterCache:
    def __init__(
        self, buffers: LoraSlotBuffers, loader: AdapterLoader,
        make_host: Callable[[LoraAdapter], HostAdapter], max_host_bytes: int, max_adapter_bytes: int,
        *, blocks: BlockManager | None = None, slot_blocks: int = 0, max_resident: int | None = None,
        load_worker: Executor | None = None, copy_worker: Executor | None = None,
    ) -> None:
        """`make_host` lays a loaded LoraAdapter out for slot copies (pinned on CUDA);
        `max_adapter_bytes` is the host size of an adapter of the largest rank allowed.
        `blocks`: the pool's block manager, whose pages adapters borrow, `slot_blocks` the most
        pages one adapter takes (None: the buffers have a pool of their own, each slot
        slot_blocks pages of it, as in the slot simulation). `max_resident`:
        the most adapters resident at once (default: as many as there are slots).
        `load_worker` runs host loads and, on CPU, `copy_worker` slot copies, one at a time
        (default: a thread each; the slot simulation passes workers on a virtual clock)."""
        if max_host_bytes < max_adapter_bytes:
            raise ValueError(f"the host tier ({max_host_bytes} bytes) cannot hold one adapter of the "
                             f"largest rank ({max_adapter_bytes} bytes)")
        self.buffers, self.num_slots = buffers, buffers.num_slots
        self.max_resident = min(self.num_slots, max_resident or self.num_slots)
        self._blocks, self.slot_blocks = blocks, slot_blocks
        if blocks is not None:
            if slot_blocks <= 0 or slot_blocks > blocks.num_blocks:
                raise ValueError(f"an adapter of {slot_blocks} pages does not fit a pool of "
                                 f"{blocks.num_blocks}")
            blocks.reclaimer = self
        self._loader, self._make_host = loader, make_host
        self.max_host_bytes, self._max_adapter_bytes = max_host_bytes, max_adapter_bytes
        self._is_cuda = buffers.device.type == "cuda"
        # Device tier. Slot 0 means "no adapter" and is never handed out.
        self._slot_of: dict[str, int] = {}
        self._holders = [0] * (self.num_slots + 1)  # running requests holding each slot
        self._copies: dict[int, _SlotCopy] = {}  # slots being filled
        self._idle: OrderedDict[int, str] = OrderedDict()  # resident, unheld: oldest use first
        self._uses = [0] * (self.num_slots + 1)  # acquisitions since the slot's adapter was loaded
        self._sizes = [0] * (self.num_slots + 1)  # host bytes of the slot's adapter
        self._pages: dict[int, list[int]] = {}  # resident slot -> the pool blocks lent to it
        # Host tier, oldest use first.
        self._host: OrderedDict[str, _HostEntry] = OrderedDict()
        self._loading: list[_HostEntry] = []
        self.host_bytes = 0
        self._needed: Counter[str] = Counter()  # queued or running requests per digest
        self._failures: dict[str, BaseException] = {}
        self._disk = load_worker or ThreadPoolExecutor(LOAD_THREADS,
                                                       thread_name_prefix="loraplex-adapter-load")
        self._copier = (None if self._is_cuda else
                        copy_worker or ThreadPoolExecutor(1, thread_name_prefix="loraplex-slot-copy"))
        self._stream = torch.cuda.Stream(buffers.device) if self._is_cuda else None
        self.num_host_loads = self.num_slot_loads = self.num_evictions = self.num_staged = 0
        """Adapters read into the host tier, copied into slots (those staged for queued
        requests among them), and evicted from slots."""

    def set_loader(self, loader: AdapterLoader) -> None:
        """Read adapters from `loader` from now on (loads under way finish with the old one)."""
        self._loader = loader

    # Demand -------------------------------------------------------------------------------
    def need(self, digest: str) -> None:
        """A request that uses `digest` was queued: its adapter stays in the host tier (once
        there) until `unneed`."""
        self._needed[digest] += 1

    def unneed(self, digest: str) -> None:
        """A request that used `digest` ended."""
        self._needed[digest] -= 1
        if self._needed[digest] <= 0:
            del self._needed[digest]

    def is_needed(self, digest: str) -> bool:
        return digest in self._needed

    # Slots for running requests -------------------------------------------------------------
    def acquire(self, digest: str) -> int | Wait:
        """A hold on the slot holding `digest`, for a request about to run, or why there is
        none yet (starting the host load or the slot copy it waits for)."""
        slot = self._slot_of.get(digest)
        if slot is not None:
            if slot in self._copies and not self._finish_copy(slot):
                return Wait.LOADING
            self._idle.pop(slot, None)
            self._holders[slot] += 1
            self._uses[slot] += 1
            return slot
        entry = self._host.get(digest)
        if entry is None:
            return Wait.LOADING if self.prefetch(digest) else Wait.NO_HOST_ROOM
        if entry.adapter is None:
            return Wait.LOADING
        place = self._free_slot(entry.adapter)
        if place is None:
            return Wait.NO_SLOT
        self._start_copy(*place, entry)
        return Wait.LOADING

    @property
    def can_stage(self) -> bool:
        """Whether `stage` may copy an adapter now: slots borrow the pool's pages (a fixed slot
        is not staged into), and fewer than max_resident adapters are resident."""
        return self._blocks is not None and len(self._slot_of) < self.max_resident

    def stage(self, digest: str) -> bool:
        """Start copying `digest` (in host memory already) into the lowest slot whose pages are
        free, for a queued request, evicting nothing; whether a copy started."""
        entry = self._host.get(digest)
        if not self.can_stage or digest in self._slot_of or entry is None or entry.adapter is None:
            return False
        place = self._lend_lowest(entry.adapter)
        if place is None:
            return False
        self._start_copy(*place, entry)
        self.num_staged += 1
        return True

    def release(self, digest: str) -> None:
        """A running request that held `digest`'s slot ended; an unheld slot stays resident,
        the most recently used."""
        slot = self._slot_of[digest]
        if self._holders[slot] <= 0:
            raise ValueError(f"adapter {digest[:12]} released more often than acquired")
        self._holders[slot] -= 1
        if self._holders[slot] == 0:
            self._idle[slot] = digest

    def is_here(self, digest: str) -> bool:
        """Whether a request for `digest` could start within milliseconds: its adapter is on the
        device (or being copied there) or in host memory (a copy away)."""
        entry = self._host.get(digest)
        return digest in self._slot_of or (entry is not None and entry.adapter is not None)

    def slot_of(self, digest: str) -> int | None:
        """The slot `digest` is in (or being copied into)."""
        return self._slot_of.get(digest)

    def device_bytes(self, digest: str) -> int:
        """Device bytes the adapter takes now (its pool pages; 0 when not resident)."""
        slot = self._slot_of.get(digest)
        return 0 if slot is None else len(self._pages[slot]) * self.buffers.page_bytes \
            // self.buffers.blocks_per_page

    def pages_of(self, digest: str) -> list[int]:
        """The pool blocks lent to `digest` (none when not resident)."""
        slot = self._slot_of.get(digest)
        return [] if slot is None else list(self._pages[slot])

    @property
    def num_adapter_blocks(self) -> int:
        """Pool blocks lent to adapters."""
        return sum(map(len, self._pages.values())) if self._blocks is not None else 0

    @property
    def resident(self) -> dict[str, int]:
        """digest -> slot of the adapters in device slots (copies finished or not)."""
        return dict(self._slot_of)

    @property
    def num_held_slots(self) -> int:
        """Slots held by running requests or being filled."""
        return sum(1 for holders in self._holders if holders) + len(
            [s for s in self._copies if not self._holders[s]])

    @property
    def num_needed(self) -> int:
        """Adapters that queued or running requests need."""
        return len(self._needed)

    @property
    def host_digests(self) -> tuple[str, ...]:
        return tuple(digest for digest, e in self._host.items() if e.adapter is not None)

    def _free_slot(self, adapter: HostAdapter) -> tuple[int, list[int]] | None:
        """(slot, pool pages) for a new adapter: a free slot and pages while fewer than
        max_resident adapters are resident, else those that evicting idle adapters frees."""
        if len(self._slot_of) < self.max_resident:
            place = self._lend_lowest(adapter)
            if place is not None:
                return place
        while self._idle:
            self._evict(self._victim())
            if len(self._slot_of) < self.max_resident:
                place = self._lend_lowest(adapter)
                if place is not None:
                    return place
        return None

    def _lend_lowest(self, adapter: HostAdapter) -> tuple[int, list[int]] | None:
        """The lowest free slot and the pages `adapter` takes (lent now), or None."""
        occupied = set(self._slot_of.values())
        slot = next((s for s in range(1, self.num_slots + 1) if s not in occupied), None)
        if slot is None:
            return None
        if self._blocks is None:
            return slot, self.buffers.own_pages_of(slot, self.buffers.pages_for(adapter))
        run = self.buffers.blocks_per_page
        blocks = self._blocks.lend_pages(self.buffers.pages_for(adapter), run)
        return None if blocks is None else (slot, blocks)

    def _victim(self) -> int:
        """The idle slot to evict: the lowest score (uses, recency, size; see the module
        docstring), those whose adapter a queued request needs last."""
        idle = list(self._idle)  # oldest use first
        max_uses = max(1, *(self._uses[s] for s in idle))
        max_size = max(1, *(self._sizes[s] for s in idle))

        def score(item: tuple[int, int]) -> tuple[bool, float]:
            position, slot = item
            return (self._idle[slot] in self._needed,
                    0.45 * self._uses[slot] / max_uses + 0.10 * (position + 1) / len(idle)
                    + 0.45 * self._sizes[slot] / max_size)

        return min(enumerate(idle), key=score)[1]

    def _evict(self, slot: int) -> None:
        """An idle slot's adapter leaves the device; the slot's blocks return to the pool."""
        digest = self._idle.pop(slot)
        del self._slot_of[digest]
        pages = self._pages.pop(slot)
        if self._blocks is not None:
            self._blocks.give_back_pages(pages)
        self.num_evictions += 1

    # Giving blocks back to the KV cache (the block manager's reclaimer) ----------------------
    @property
    def num_reclaimable_blocks(self) -> int:
        return sum(len(self._pages[s]) for s in self._idle) if self._blocks is not None else 0

    def reclaim(self, num_blocks: int) -> None:
        """Evict idle adapters until at least `num_blocks` blocks are back (or none is idle)."""
        freed = 0
        while freed < num_blocks and self._idle and self._blocks is not None:
            victim = self._victim()
            freed += len(self._pages[victim])
            self._evict(victim)

    def _start_copy(self, slot: int, blocks: list[int], entry: _HostEntry) -> None:
        """Copy entry's adapter into `slot` and its pool `blocks` (its adapter pages' blocks)."""
        self._slot_of[entry.digest] = slot
        self._pages[slot] = blocks
        run = self.buffers.blocks_per_page
        pages = blocks if self._blocks is None else [b // run for b in blocks[::run]]
        self._uses[slot], self._sizes[slot] = 0, entry.adapter.num_bytes
        entry.num_copies += 1
        adapter = entry.adapter
        if self._stream is not None:
            # After every step launched so far: they may still read the slot's old adapter.
            self._stream.wait_stream(torch.cuda.current_stream(self.buffers.device))
            with torch.cuda.stream(self._stream):
                self.buffers.load(slot, adapter, pages)
                done: torch.cuda.Event | Future = torch.cuda.Event()
                done.record(self._stream)
        else:
            done = self._copier.submit(self.buffers.load, slot, adapter, pages)
        self._copies[slot] = _SlotCopy(entry.digest, entry, done)
        self.num_slot_loads += 1

    def _finish_copy(self, slot: int) -> bool:
        """Whether the copy into `slot` is done (and if so, its bookkeeping closed)."""
        copy = self._copies[slot]
        if isinstance(copy.done, Future):
            if not copy.done.done():
                return False
            copy.done.result()  # a failed copy raises here, on the engine thread
        elif not copy.done.query():
            return False
        else:
            # Steps launched from now on read the slot; order them after the copy.
            torch.cuda.current_stream(self.buffers.device).wait_event(copy.done)
        del self._copies[slot]
        copy.entry.num_copies -= 1
        self._idle[slot] = copy.digest  # resident; the caller holds it at once, or it idles
        return True

    def poll(self) -> None:
        """Close the bookkeeping of loads and copies that finished (call once a step)."""
        self._collect_loads()
        for slot in list(self._copies):
            self._finish_copy(slot)

    def settle(self, timeout: float = 30.0) -> None:
        """Wait for the host loads and slot copies under way and close their bookkeeping. A
        request aborted mid-copy leaves its slot being filled until the copy ends; the engine
        just polls at its next steps, a caller that must see every slot free waits here."""
        deadline = time.monotonic() + timeout
        while self._loading or self._copies:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{len(self._loading)} adapter loads and {len(self._copies)} "
                                   f"slot copies still under way after {timeout:g} s")
            pending = [e.loading for e in self._loading]
            pending += [c.done for c in self._copies.values() if isinstance(c.done, Future)]
            wait(pending, timeout=remaining)
            for copy in self._copies.values():
                if not isinstance(copy.done, Future):
                    copy.done.synchronize()
            self.poll()

    # The host tier ------------------------------------------------------------------------
    def prefetch(self, digest: str) -> bool:
        """Start loading `digest` into the host tier if it is neither there nor resident on the
        device, and there is room (dropping unneeded adapters, oldest use first); False if there
        is no room. (A resident adapter needs no host copy to run: reading it again for requests
        queued behind full running places cost the serving pass 15-32 host loads a run with no
        device load.)"""
        if digest in self._slot_of:
            return True
        if digest in self._host:
            self._host.move_to_end(digest)
            return True
        if not self._make_room(self._max_adapter_bytes):
            return False
        entry = _HostEntry(digest, self._max_adapter_bytes)
        self._host[digest] = entry
        self.host_bytes += entry.reserved
        entry.loading = self._disk.submit(self._load, digest)
        self._loading.append(entry)
        return True

    def _load(self, digest: str) -> HostAdapter:
        """On the worker thread: read, validate and lay out one adapter."""
        loaded = self._loader(digest)
        host = loaded if isinstance(loaded, HostAdapter) else self._make_host(loaded)
        if host.digest != digest:
            raise ValueError(f"the loader gave adapter {host.digest[:12]} for {digest[:12]}")
        prepare = getattr(self.buffers, "prepare", None)
        if prepare is not None:  # laid out as the pool's pages here, not on the engine's thread
            prepare(host)
        return host

    def _collect_loads(self) -> None:
        done = [e for e in self._loading if e.loading.done()]
        if not done:
            return
        self._loading = [e for e in self._loading if not e.loading.done()]
        for entry in done:
            future, entry.loading = entry.loading, None
            try:
                entry.adapter = future.result()
            except Exception as exc:  # noqa: BLE001 - the requests that need it fail with it
                logger.warning("could not load adapter %s: %s", entry.digest[:12], exc)
                self._drop(entry)
                self._failures[entry.digest] = exc
                continue
            self.host_bytes += entry.adapter.num_bytes - entry.reserved
            entry.reserved = entry.adapter.num_bytes
            self.num_host_loads += 1

    def take_failures(self) -> dict[str, BaseException]:
        """Adapters whose load failed since the last call (the requests that need them should
        fail); a later request for one of them tries again."""
        self._collect_loads()
        failures, self._failures = self._failures, {}
        return failures

    def _make_room(self, num_bytes: int) -> bool:
        if self.host_bytes + num_bytes <= self.max_host_bytes:
            return True
        droppable = [e for e in self._host.values()
                     if e.adapter is not None and not e.num_copies and e.digest not in self._needed]
        for entry in droppable:
            self._drop(entry)
            if self.host_bytes + num_bytes <= self.max_host_bytes:
                return True
        return False

    def _drop(self, entry: _HostEntry) -> None:
        del self._host[entry.digest]
        self.host_bytes -= entry.reserved

    # Removal and shutdown -----------------------------------------------------------------
    def forget(self, digest: str) -> None:
        """Drop an adapter that no request uses (it was removed): its slot and host copy."""
        if digest in self._needed:
            raise ValueError(f"adapter {digest[:12]} is in use")
        slot = self._slot_of.get(digest)
        if slot is not None and slot in self._idle:
            self._evict(slot)
        entry = self._host.get(digest)
        if entry is not None and entry.loading is None and not entry.num_copies:
            self._drop(entry)

    def close(self) -> None:
        self._disk.shutdown(wait=False, cancel_futures=True)
        if self._copier is not None:
            self._copier.shutdown(wait=True)

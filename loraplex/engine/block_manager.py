"""Paged bookkeeping of the device memory pool: which blocks (pages) are free, reference
counts for shared KV blocks, and pages lent to adapters. Pure Python; the pool's
buffer itself lives in the engine (the KV cache and the adapter slots are views of it)."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Protocol


class Reclaimer(Protocol):
    """Whoever borrows blocks (the adapter cache) and can give some back on demand."""

    @property
    def num_reclaimable_blocks(self) -> int:
        """Lent blocks that `reclaim` could give back now (idle adapters')."""

    def reclaim(self, num_blocks: int) -> None:
        """Give back at least `num_blocks` lent blocks (if it can)."""


class BlockManager:
    """Hands out KV blocks of `block_size` tokens. A block returns to the free list when its
    reference count drops to zero (a shared prefix block is held by every request using it).

    With the prefix cache on, full prompt blocks are registered under their content hash
    (loraplex/engine/prefix_cache.py) when they are allocated, and count as computed once the
    step that writes them is launched. A request whose prompt starts with computed cached blocks
    takes references to them (`match`). A cached block that nobody holds keeps its KV and is
    evictable: it is handed out again, least recently used first, only when no plain free block
    is left. A cached block that nobody holds before it was computed is forgotten. Holding a
    reference is also how a prefix is pinned: a held block is never evicted.

    The blocks are the pages of one pool that adapters share (loraplex/engine/lora_weights.py):
    KV blocks are handed out from the top of the pool down, and an adapter's pages (as many as
    its own rank needs, any of them), from the bottom up, are lent to it (`lend_pages`) while
    it is resident. When KV runs short, the
    plain free blocks go first, then cached blocks nobody holds, then the `reclaimer` gives back
    idle adapters' blocks (before the scheduler preempts anyone). Every block is always exactly
    one of: held (KV), lent (adapters), free (plain or cached)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 max_kv_blocks: int | None = None) -> None:
        """`max_kv_blocks`: the most blocks the KV cache may take, held and cached (default: all)."""
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_kv_blocks = max_kv_blocks or num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._free = [-block for block in range(num_blocks)]  # heap: highest block first
        heapq.heapify(self._free)
        self._is_free = [True] * num_blocks  # (the heap may hold stale entries: checked here)
        self._num_free = num_blocks
        self._lent = [False] * num_blocks
        self._low = list(range(num_blocks))
        """Min-heap of blocks that may be lendable (pushed when a block's last holder lets go or
        an adapter gives it back; stale entries are dropped when popped): lending finds the
        lowest lendable pages without scanning the thousands of lent and held blocks below them."""
        self.num_lent_blocks = 0
        """Blocks lent to adapters."""
        self._fresh: set[int] = set()  # freed since the step being planned began: not lent
        self.reclaimer: Reclaimer | None = None
        self._refs = [0] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unheld; LRU first
        self._hash_of: dict[int, bytes] = {}  # cached block -> its hash
        self._block_of: dict[bytes, int] = {}  # hash -> cached block
        self._computing: set[int] = set()  # cached blocks whose KV is not written yet
        self.num_queried_tokens = self.num_hit_tokens = self.num_evicted_blocks = 0
        """Prefix cache counters: prompt tokens looked up, found, and cached blocks evicted."""
        self.peak_used_blocks = 0
        """The most blocks held at once (benchmarks set it back to 0 between runs)."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks neither held nor lent: plain free ones and evictable cached ones."""
        return self._num_free + len(self._evictable)

    @property
    def num_available_blocks(self) -> int:
        """Blocks that `allocate` can hand out: the free ones and those idle adapters would give
        back."""
        reclaimable = self.reclaimer.num_reclaimable_blocks if self.reclaimer is not None else 0
        return min(self.num_free_blocks + reclaimable, self.max_kv_blocks - self.num_used_blocks)

    @property
    def num_used_blocks(self) -> int:
        """Blocks KV holders hold."""
        return self.num_blocks - self.num_free_blocks - self.num_lent_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, held or not."""
        return len(self._hash_of)

    @property
    def num_shared_blocks(self) -> int:
        """Blocks held by more than one holder (counted once each)."""
        return sum(refs > 1 for refs in self._refs)

    def blocks_needed(self, num_tokens: int, num_held: int) -> int:
        """Blocks to add to a holder of `num_held` blocks so that it fits `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks, or None (and nothing taken) if too few are available. Evicts
        cached blocks nobody holds, least recently used first, once the plain free list is
        empty, and has idle adapters give their blocks back once those are gone too."""
        if count > self.num_available_blocks:
            return None
        if count > self.num_free_blocks:
            self.reclaimer.reclaim(count - self.num_free_blocks)
            if count > self.num_free_blocks:
                return None
        blocks = []
        room = self.max_kv_blocks - self.num_used_blocks - len(self._evictable)  # plain ones KV may take
        for i in range(count):
            block = self._pop_free() if i < room else None
            if block is None:
                block, _ = self._evictable.popitem(last=False)
                self._uncache(block)
                self.num_evicted_blocks += 1
            self._refs[block] = 1
            blocks.append(block)
        self._note_peak()
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Take another reference to blocks already held by someone."""
        for block in blocks:
            if self._refs[block] <= 0:
                raise ValueError(f"block {block} is not allocated")
            self._refs[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the free list (a
        computed cached block to the evictable end of it)."""
        for block in blocks:
            refs = self._refs[block] - 1
            if refs < 0:
                raise ValueError(f"block {block} freed more often than allocated")
            self._refs[block] = refs
            if refs > 0:
                continue
            self._fresh.add(block)
            self._push_low(block)
            if block in self._hash_of and block not in self._computing:
                self._evictable[block] = None
            else:
                self._uncache(block)
                self._push_free(block)

    def _pop_free(self) -> int | None:
        """The highest plain free block (taken off the free list), or None."""
        while self._free:
            block = -heapq.heappop(self._free)
            if self._is_free[block]:
                self._is_free[block] = False
                self._num_free -= 1
                return block
        return None

    def _push_free(self, block: int) -> None:
        self._is_free[block] = True
        self._num_free += 1
        heapq.heappush(self._free, -block)
        if len(self._free) > 2 * self.num_blocks:  # drop the stale entries lending left
            self._free = [-b for b in range(self.num_blocks) if self._is_free[b]]
            heapq.heapify(self._free)

    # Lending to adapters ---------------------------------------------------------------------
    def _can_lend(self, block: int) -> bool:
        """Free (cached ones nobody holds count as free), and not freed in the step being planned
        (its swap-outs may still read it)."""
        return self._refs[block] == 0 and not self._lent[block] and block not in self._fresh

    def lend_pages(self, count: int, run: int = 1) -> list[int] | None:
        """Lend `count` pages (any, not contiguous) of `run` blocks each (aligned runs) to an
        adapter, the lowest that `_can_lend` first (KV comes from the top down), evicting cached
        ones: their blocks, page by page; None (and nothing lent) if fewer are free."""
        need = count * run
        if need > self.num_free_blocks:
            return None
        firsts, waiting, tried = [], [], set()
        while len(firsts) * run < need and self._low:
            block = heapq.heappop(self._low)
            first = block - block % run
            if first in tried or first + run > self.num_blocks:
                continue
            tried.add(first)
            run_blocks = range(first, first + run)
            if all(self._can_lend(b) for b in run_blocks):
                firsts.append(first)
            elif all(self._refs[b] == 0 and not self._lent[b] for b in run_blocks):
                waiting.append(first)  # freed this step: lendable from the next
            # else a block of the run is held or lent: it comes back to the heap when released
        for first in waiting if len(firsts) * run == need else waiting + firsts:
            heapq.heappush(self._low, first)
        if len(firsts) * run < need:
            return None
        pages = [block for first in firsts for block in range(first, first + run)]
        for block in pages:
            if self._evictable.pop(block, 0) is None:
                self._uncache(block)
                self.num_evicted_blocks += 1
            else:
                self._is_free[block] = False
                self._num_free -= 1
            self._lent[block] = True
        self.num_lent_blocks += len(pages)
        return pages

    def give_back_pages(self, pages: list[int]) -> None:
        """An adapter's pages return to the free list."""
        for block in pages:
            if not self._lent[block]:
                raise ValueError(f"block {block} is not lent")
            self._lent[block] = False
            self._push_free(block)
            self._push_low(block)
        self.num_lent_blocks -= len(pages)

    def _push_low(self, block: int) -> None:
        heapq.heappush(self._low, block)
        if len(self._low) > 2 * self.num_blocks:  # drop the stale entries
            self._low = [b for b in range(self.num_blocks) if self._refs[b] == 0 and not self._lent[b]]

    def start_step(self) -> None:
        """A new step is being planned: blocks freed before now may be lent (the steps that
        read or swap them out are queued before any copy into them starts)."""
        self._fresh.clear()

    # Prefix cache --------------------------------------------------------------------------
    def match(self, hashes: list[bytes], max_blocks: int) -> list[int]:
        """References to the cached, computed blocks that the first of `hashes` name, as many
        in a row as are found (at most `max_blocks`)."""
        blocks = [self._block_of[h] for h in hashes[:self.num_hits(hashes[:max_blocks])]]
        for block in blocks:
            self._evictable.pop(block, None)
            self._refs[block] += 1
        self._note_peak()
        self.num_queried_tokens += min(len(hashes), max_blocks) * self.block_size
        self.num_hit_tokens += len(blocks) * self.block_size
        return blocks

    def num_hits(self, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, name cached computed blocks (nothing taken)."""
        if not self.enable_prefix_caching:
            return 0
        count = 0
        for block_hash in hashes:
            block = self._block_of.get(block_hash)
            if block is None or block in self._computing:
                break
            count += 1
        return count

    def is_computing(self, block_hash: bytes) -> bool:
        """Another holder's step is about to write the block of that hash."""
        block = self._block_of.get(block_hash)
        return block is not None and block in self._computing

    def register(self, blocks: list[int], hashes: list[bytes]) -> None:
        """Cache freshly allocated blocks under their hashes (pairs up to the shorter list), as
        not computed yet. A hash already cached keeps its block; this one stays private."""
        if not self.enable_prefix_caching:
            return
        for block, block_hash in zip(blocks, hashes):
            if block_hash not in self._block_of:
                self._block_of[block_hash], self._hash_of[block] = block, block_hash
                self._computing.add(block)

    def mark_computed(self, blocks: list[int]) -> None:
        """The step that writes these blocks is launched: later steps may read them."""
        self._computing.difference_update(blocks)

    def num_shared_prefix(self, blocks: list[int]) -> int:
        """How many of `blocks`, from the first, are computed cached blocks that someone else
        holds too (a pinned prompt, another request): blocks that a holder may let go of and
        find again by their hash. A block that only one holder holds would be evictable once it
        lets go, and under the pressure that made it let go, soon evicted."""
        count = 0
        for block in blocks:
            if block not in self._hash_of or block in self._computing or self._refs[block] < 2:
                break
            count += 1
        return count

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody holds (held ones stay cached); returns how many.
        Benchmarks start each run cold with it."""
        count = len(self._evictable)
        evictable, self._evictable = self._evictable, OrderedDict()
        for block in evictable:
            self._uncache(block)
            self._push_free(block)
        return count

    def _note_peak(self) -> None:
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)

    def _uncache(self, block: int) -> None:
        block_hash = self._hash_of.pop(block, None)
        if block_hash is not None:
            del self._block_of[block_hash]
        self._computing.discard(block)


class HostBlockPool:
    """Host blocks for swapped-out KV (the pool's tensor lives in the model runner). A holder
    takes blocks and gives them back; no sharing. Blocks come in contiguous runs where it can,
    so a swap is few large copies: fresh blocks are handed out in order, freed ones lowest
    first. Pure Python; costs nothing per block never used."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._next = 0  # blocks from here on were never handed out
        self._free: list[int] = []  # handed out once and returned, ascending

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._next + len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def allocate(self, count: int) -> list[int] | None:
        """`count` blocks, or None (and nothing taken) if too few are free."""
        if count > self.num_free_blocks:
            return None
        fresh = min(count, self.num_blocks - self._next) if len(self._free) < count else 0
        blocks = list(range(self._next, self._next + fresh))
        self._next += fresh
        taken, self._free = self._free[:count - fresh], self._free[count - fresh:]
        return taken + blocks

    def free(self, blocks: list[int]) -> None:
        if blocks:
            self._free = sorted(self._free + blocks)

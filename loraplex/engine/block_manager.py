"""Paged KV bookkeeping: which blocks are free, reference counts for shared blocks.
Pure Python; the KV tensor itself lives in the model runner."""

from __future__ import annotations

from collections import OrderedDict, deque


class BlockManager:
    """Hands out KV blocks of `block_size` tokens. A block returns to the free list when its
    reference count drops to zero (a shared prefix block is held by every request using it).

    With the prefix cache on, full prompt blocks are registered under their content hash
    (loraplex/engine/prefix_cache.py) when they are allocated, and count as computed once the
    step that writes them is launched. A request whose prompt starts with computed cached blocks
    takes references to them (`match`). A cached block that nobody holds keeps its KV and is
    evictable: it is handed out again, least recently used first, only when no plain free block
    is left. A cached block that nobody holds before it was computed is forgotten. Holding a
    reference is also how a prefix is pinned: a held block is never evicted."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
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
        """Blocks that `allocate` can hand out: plain free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks someone holds."""
        return self.num_blocks - self.num_free_blocks

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
        """`count` fresh blocks, or None (and nothing taken) if too few are free. Evicts cached
        blocks nobody holds, least recently used first, once the plain free list is empty."""
        if count > self.num_free_blocks:
            return None
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:
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
            if block in self._hash_of and block not in self._computing:
                self._evictable[block] = None
            else:
                self._uncache(block)
                self._free.append(block)

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
        for block in self._evictable:
            self._uncache(block)
            self._free.append(block)
        self._evictable.clear()
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

"""Paged KV bookkeeping: which blocks are free, reference counts for shared blocks.
Pure Python; the KV tensor itself lives in the model runner."""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Hands out KV blocks of `block_size` tokens. A block returns to the free list when its
    reference count drops to zero (a shared prefix block is held by every request using it)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int, num_held: int) -> int:
        """Blocks to add to a holder of `num_held` blocks so that it fits `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks, or None (and nothing taken) if too few are free."""
        if count > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Take another reference to blocks already held by someone."""
        for block in blocks:
            if self._refs[block] <= 0:
                raise ValueError(f"block {block} is not allocated")
            self._refs[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the free list."""
        for block in blocks:
            refs = self._refs[block] - 1
            if refs < 0:
                raise ValueError(f"block {block} freed more often than allocated")
            self._refs[block] = refs
            if refs == 0:
                self._free.append(block)


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

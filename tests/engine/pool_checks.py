"""Checks of the memory pool's page accounting, shared by the engine tests."""

from __future__ import annotations


def assert_pool_accounting(engine) -> None:
    """Every page of the pool is exactly one of: held KV, lent to an adapter slot (slot 0's and
    each resident adapter's), free; the block manager's counters agree with a count block by
    block."""
    blocks, cache = engine.blocks, engine.adapters
    refs, lent = blocks._refs, blocks._lent
    held = sum(r > 0 for r in refs)
    num_lent = sum(lent)
    free = sum(blocks._is_free) + len(blocks._evictable)
    assert not any(r > 0 and is_lent for r, is_lent in zip(refs, lent))
    assert held + num_lent + free == blocks.num_blocks
    assert (blocks.num_used_blocks, blocks.num_lent_blocks, blocks.num_free_blocks) == (held, num_lent, free)
    assert num_lent == cache.num_adapter_blocks == (len(cache.resident) + 1) * cache.slot_blocks
    for slot in (0, *cache.resident.values()):
        first = slot * cache.slot_blocks
        assert all(lent[first:first + cache.slot_blocks]), f"slot {slot}'s pages are not all lent"

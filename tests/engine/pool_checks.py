"""Checks of the memory pool's page accounting, shared by the engine tests."""

from __future__ import annotations


def assert_pool_accounting(engine) -> None:
    """Every page of the pool is exactly one of: held KV, lent to one resident adapter (as many
    as its own rank needs), free; the block manager's counters agree with a count block by
    block."""
    blocks, cache = engine.blocks, engine.adapters
    refs, lent = blocks._refs, blocks._lent
    held = sum(r > 0 for r in refs)
    num_lent = sum(lent)
    free = sum(blocks._is_free) + len(blocks._evictable)
    assert not any(r > 0 and is_lent for r, is_lent in zip(refs, lent))
    assert held + num_lent + free == blocks.num_blocks
    assert (blocks.num_used_blocks, blocks.num_lent_blocks, blocks.num_free_blocks) == (held, num_lent, free)
    assert num_lent == cache.num_adapter_blocks
    lent_to = [b for digest in cache.resident for b in cache.pages_of(digest)]
    assert sorted(lent_to) == [b for b, is_lent in enumerate(lent) if is_lent], "pages lent twice or leaked"
    for digest in cache.resident:  # pages for its own rank
        entry = cache._host.get(digest)
        if entry is not None and entry.adapter is not None:
            expected = cache.buffers.blocks_per_page * cache.buffers.pages_for(entry.adapter)
            assert len(cache.pages_of(digest)) == expected

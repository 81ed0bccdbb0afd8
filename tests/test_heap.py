"""The start-up heap's freeze (loraplex.heap)."""

from __future__ import annotations

import gc

from loraplex.heap import freeze_startup_heap


def test_freezing_moves_what_is_alive_out_of_full_collections():
    kept = [[i] for i in range(10_000)]  # alive at the freeze
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() >= len(kept)
        collected = {id(o) for o in gc.get_objects(generation=2)}  # what a full collection walks
        assert not any(id(x) in collected for x in kept)
    finally:
        gc.unfreeze()  # (this test process goes on: give the objects back to the collector)
    assert gc.get_freeze_count() == 0

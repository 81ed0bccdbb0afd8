"""The Python heap of a long-running process (the server, the engine-core process)."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now (the model's modules, the tokenizer, the
    imported libraries: hundreds of thousands) out of the garbage collector's sight: its full
    collections, which otherwise walk them all while every thread waits for the GIL, then walk
    only what serving allocates (as vLLM does after start-up). Measured on our 2-core CPU with
    the synthetic server's engine (Llama-3's 128,256-token vocabulary): 340,000 objects, a full
    collection 250-280 ms before, under 1 ms after. Returns the objects frozen. For a process's
    entry point, once, when start-up is done (objects frozen that later become cyclic garbage
    are never collected)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

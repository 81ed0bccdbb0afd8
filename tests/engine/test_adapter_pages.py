"""Rank pages: an adapter's device bytes follow its own rank (issue 27), and the packing of rank
pages into pool pages is exact (no overlap, nothing across a page, aligned)."""

import pytest
import torch

from loraplex.benchmarks.synthetic import model_config
from loraplex.engine.adapter_pages import (
    PAGE_ALIGN,
    adapter_page_sizes,
    adapter_pool_pages,
    place_blocks,
)
from loraplex.engine.lora_weights import adapter_bytes, pool_slot_bytes
from loraplex.engine.sizing import kv_block_bytes

LLAMA = model_config()


def test_llama3_8b_adapters_take_pool_pages_in_proportion_to_their_rank():
    page = kv_block_bytes(LLAMA, 16, torch.bfloat16)  # 2 MiB
    pages = {r: adapter_pool_pages(LLAMA, r, torch.bfloat16, page) for r in (8, 16, 64)}
    weights = {r: sum(adapter_page_sizes(LLAMA, r, torch.bfloat16)) for r in (8, 16, 64)}
    assert weights[16] == 2 * weights[8] and weights[64] == 8 * weights[8]
    assert weights[16] == adapter_bytes(LLAMA, 16, torch.bfloat16) - adapter_bytes(LLAMA, 0, torch.bfloat16)
    # Packing loses at most a page: rank 16 is 80 MiB (83.9 MB), 40 pages of 2 MiB exactly.
    for r, n in pages.items():
        assert weights[r] <= n * page <= 1.05 * weights[r] + page, (r, n)
    assert pages == {8: 20, 16: 40, 64: 161}
    # Step 1's slots took --max-lora-rank's pages for any adapter (a rank 8 took a rank 64's pages).
    slot_pages = pool_slot_bytes(LLAMA, 64, torch.bfloat16, page) // page
    assert slot_pages >= pages[64] and pages[8] / slot_pages < 0.13


def test_vectors_add_a_page_at_most():
    page = kv_block_bytes(LLAMA, 16, torch.bfloat16)
    assert adapter_pool_pages(LLAMA, 16, torch.bfloat16, page, with_vectors=True) - \
        adapter_pool_pages(LLAMA, 16, torch.bfloat16, page) <= 4


def test_place_blocks_packs_first_fit_aligned_and_never_across_a_page():
    sizes = [3000, 100, 1000, 4096, 256, 700, 1]
    num_pages, placed = place_blocks(sizes, 4096)
    spans = sorted((page * 4096 + start, page * 4096 + start + size)
                   for size, (page, start) in zip(sizes, placed))
    assert all(start % PAGE_ALIGN == 0 for _, start in placed)
    assert all(start + size <= 4096 for size, (_, start) in zip(sizes, placed))
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert num_pages == 3
    with pytest.raises(ValueError, match="does not fit"):
        place_blocks([5000], 4096)

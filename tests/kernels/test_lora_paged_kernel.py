"""The paged adapter kernels (lora_paged.py, adapter_families_paged.py) against their references,
and against the slot kernels' references on the same weights: rank pages on shuffled pool pages,
every byte of the pool outside them NaN (a read past a rank, of slot 0, or of a wrong page shows).
Under the interpreter in float32 and float16 on the CPU, in bf16 at Llama-3-8B shapes on the GPU."""

import random

import pytest
import torch

from loraplex.engine.adapter_pages import page_slot_group
from loraplex.kernels import adapter_families_paged as famp
from loraplex.kernels import lora, lora_paged
from loraplex.kernels import reference as ref
from tests.kernels.kernel_testing import (
    DEVICE,
    INTERPRETER_DTYPES,
    assert_close_bf16,
    gpu,
    guarded_1d,
    guarded_rows,
    poisoned_allocations,
    skip_without_cuda,
)
from tests.kernels.test_adapter_families_kernel import SLICES, SLOTS, _flora_case, _scales, _slice_products
from tests.kernels.test_lora_kernel import RANKS, _slot_buffers

PAGE_BYTES = 4096


def _page(a, bt, ranks, offsets, scale=None, shift=None, scaled=None, num_pages=256, seed=0,
          page_bytes=PAGE_BYTES):
    """Dense slot buffers copied into rank pages of a NaN pool, on shuffled pool pages."""
    pool = torch.full((num_pages * page_bytes,), 0xFF, dtype=torch.uint8, device=a.device)  # NaN
    free = list(range(num_pages))
    random.Random(seed).shuffle(free)
    paged = page_slot_group(pool, page_bytes, free.pop, a, bt, ranks, offsets, scale, shift, scaled)
    return pool, paged


def _lora_case(ranks, in_features, slice_sizes, max_rank, dtype, seed=0, device=DEVICE):
    a, b, ranks_t, offsets = _slot_buffers(ranks, in_features, slice_sizes, max_rank, dtype, device,
                                           seed=seed)
    pool, paged = _page(a, b.transpose(1, 2), ranks_t, offsets, seed=seed)
    return a, b, ranks_t, offsets, pool, paged


def _check_lora(path, monkeypatch, ranks, in_features, slice_sizes, max_rank, slot_list,
                dtype=torch.float32, seed=0):
    if path.startswith("tiles"):  # the tl.dot path (BLOCK_M > 1) at this tiny batch
        monkeypatch.setattr(lora_paged, "shrink_config", _tiles(lora.shrink_config))
        monkeypatch.setattr(lora_paged, "expand_config", _tiles(lora.expand_config))
    a, b, ranks_t, offsets, pool, paged = _lora_case(ranks, in_features, slice_sizes, max_rank, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(len(slot_list), in_features, generator=g).to(DEVICE, dtype)
    y = torch.randn(len(slot_list), offsets[-1], generator=g).to(DEVICE, dtype)
    slots = guarded_1d(torch.tensor(slot_list, dtype=torch.int32, device=DEVICE))
    split = _split_for(path, slots)
    weights = pool.view(dtype)
    with poisoned_allocations(lora_paged):
        shrunk = lora_paged.lora_shrink_paged(guarded_rows(x), weights, paged.a_pages, slots, ranks_t,
                                              max_rank, split)
        out = lora_paged.lora_expand_paged(guarded_rows(y), shrunk, weights, paged.b_pages, slots, ranks_t,
                                           offsets, split=split)
    want_shrunk = ref.lora_shrink_paged(x, weights, paged.a_pages, slots, ranks_t, max_rank)
    want_y = ref.lora_expand_paged(y.clone(), want_shrunk, weights, paged.b_pages, slots, ranks_t, offsets)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(shrunk, want_shrunk, atol=tol, rtol=tol)
    torch.testing.assert_close(out, want_y, atol=tol, rtol=tol)
    # The paged reference is the slot reference on the same weights (in half precision up to an
    # output's last bit: on a GPU the two sum in different orders before rounding).
    slot_shrunk = ref.lora_shrink(x, a, slots, ranks_t)
    torch.testing.assert_close(want_shrunk, slot_shrunk, atol=1e-6, rtol=1e-5)
    bit = (1e-6, 1e-5) if dtype == torch.float32 else (0.0, 2 * torch.finfo(dtype).eps)
    torch.testing.assert_close(want_y, ref.lora_expand(y.clone(), slot_shrunk, b, slots, ranks_t, offsets),
                               atol=bit[0], rtol=bit[1])
    return out, y


def _split_for(path: str, slots: torch.Tensor):
    """"tiles": runs of a slot in the tiles, lone tokens through the per-token kernels
    (lora_paged.SPLIT_LONE's split, as the model runner makes it); otherwise no split."""
    return ref.lone_split(slots) if path == "tiles" else None


def _tiles(config_of):
    def forced(num_tokens, *args):
        return config_of(lora.MAX_GEMV_TOKENS + 1, *args)
    return forced


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("path", ["gemv", "tiles", "tiles-unsplit"])
@pytest.mark.parametrize("slot_list", [
    [0, 2, 1, 2, 0, 3, 1, 1, 2],
    # runs (a prompt chunk) beside lone tokens (decode rows), at both ends and between
    [3, 3, 3, 1, 2, 1, 0, 0, 2, 2, 2, 2, 3, 1, 1],
])
def test_paged_shrink_expand_match_references_mixed_slots_and_ranks(dtype, path, slot_list, monkeypatch):
    out, y = _check_lora(path, monkeypatch, RANKS, 40, (24, 8, 16), 8, slot_list, dtype)
    untouched = torch.tensor(slot_list, device=DEVICE) == 0
    assert torch.equal(out[untouched], y[untouched])


def test_lone_split_lists_tokens_whose_neighbours_carry_other_slots(monkeypatch):
    slots = torch.tensor([3, 3, 1, 2, 1, 0, 0, 2], dtype=torch.int32)
    split = ref.lone_split(slots)
    assert split.lone_tokens.tolist() == [2, 3, 4, 7, -1, -1, -1, -1]
    assert split.run_slots.tolist() == [3, 3, 0, 0, 0, 0, 0, 0]
    # Past MAX_LONE_TOKENS the lone tokens stay in the tiles.
    monkeypatch.setattr(ref, "MAX_LONE_TOKENS", 2)
    split = ref.lone_split(slots)
    assert split.lone_tokens.tolist() == [2, 3]
    assert split.run_slots.tolist() == [3, 3, 0, 0, 1, 0, 0, 2]
    assert ref.lone_split(torch.tensor([5], dtype=torch.int32)).lone_tokens.tolist() == [0]


@pytest.mark.parametrize("path", ["gemv", "tiles", "tiles-unsplit"])
def test_paged_ranks_1_to_64_across_page_bounds(path, monkeypatch):
    """Ranks 1, 7, 9, 16, 24 and 64 in tables of max rank 64: rows across rank-page bounds."""
    ranks = [[64, 64], [1, 9], [16, 64], [64, 7], [24, 16]]
    _check_lora(path, monkeypatch, ranks, 48, (24, 40), 64, [4, 1, 3, 0, 2, 1], seed=3)


@pytest.mark.parametrize("path", ["gemv", "tiles"])
def test_unchecked_shrink_expand_give_the_checked_results(path, monkeypatch):
    """The engine's forward (triton_ops(check_inputs=False)) launches what the wrappers launch."""
    if path == "tiles":
        monkeypatch.setattr(lora_paged, "shrink_config", _tiles(lora.shrink_config))
        monkeypatch.setattr(lora_paged, "expand_config", _tiles(lora.expand_config))
    *_, ranks_t, offsets, pool, paged = _lora_case(RANKS, 40, (24, 8, 16), 8, torch.float32)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 40, generator=g).to(DEVICE)
    y = torch.randn(6, offsets[-1], generator=g).to(DEVICE)
    slots = torch.tensor([0, 2, 1, 2, 3, 1], dtype=torch.int32, device=DEVICE)
    weights = pool.view(torch.float32)
    split = _split_for(path, slots)
    shrunk = lora_paged.lora_shrink_paged(x, weights, paged.a_pages, slots, ranks_t, 8, split)
    fast = lora_paged.lora_shrink_paged_unchecked(x, weights, paged.a_pages, slots, ranks_t, 8, split)
    assert torch.equal(fast, shrunk)
    want = lora_paged.lora_expand_paged(y.clone(), shrunk, weights, paged.b_pages, slots, ranks_t, offsets,
                                        split=split)
    got = lora_paged.lora_expand_paged_unchecked(y.clone(), shrunk, weights, paged.b_pages, slots, ranks_t,
                                                 tuple(offsets), split=split)
    assert torch.equal(got, want)


def test_paged_ranks_take_pages_for_their_own_rank():
    ranks = [[0, 0], [8, 8], [16, 16], [64, 64], [3, 3]]
    *_, paged = _lora_case(ranks, 64, (32, 32), 64, torch.float32)
    num_pages = [len(pages) for pages in paged.pages]
    # Rank 8: two A rank pages (8 x 64 x 4 = 2 KiB each) and two of B (1 KiB): 6 KiB, 2 pool
    # pages of 4 KiB; rank 16: 12 KiB, 3; rank 64: 48 KiB, 12; rank 3 takes rank 8's pages.
    assert num_pages == [0, 2, 3, 12, 2]


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("path", ["gemv", "tiles", "tiles-unsplit"])
@pytest.mark.parametrize("with_shift", [False, True])
def test_paged_dora_ia3_epilogue_matches_the_slot_reference(dtype, path, with_shift, monkeypatch):
    if path.startswith("tiles"):
        monkeypatch.setattr(lora_paged, "expand_config", _tiles(lora.expand_config))
    a, b, ranks, offsets = _slot_buffers(RANKS, 40, SLICES, 8, dtype, DEVICE)
    scale, scaled, shift = _scales(len(RANKS), offsets[-1], (1, 3), with_shift, DEVICE)
    pool, paged = _page(a, b.transpose(1, 2), ranks, offsets, scale, shift, scaled.tolist())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(SLOTS), 40, generator=g).to(DEVICE, dtype)
    y = torch.randn(len(SLOTS), offsets[-1], generator=g).to(DEVICE, dtype)
    slots = guarded_1d(torch.tensor(SLOTS, dtype=torch.int32, device=DEVICE))
    shrunk = ref.lora_shrink(x, a, slots, ranks)
    shift_at = paged.shift_at if with_shift else None
    vectors = pool.view(torch.float32)
    out = lora_paged.lora_expand_paged(guarded_rows(y), shrunk, pool.view(dtype), paged.b_pages, slots,
                                       ranks, offsets, vectors, paged.scale_at, shift_at,
                                       _split_for(path, slots))
    want = ref.lora_expand(y.clone(), shrunk, b, slots, ranks, offsets, scale, scaled, shift)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    paged_ref = ref.lora_expand_paged(y.clone(), shrunk, pool.view(dtype), paged.b_pages, slots, ranks,
                                      offsets, vectors, paged.scale_at, shift_at)
    torch.testing.assert_close(paged_ref, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
def test_paged_scale_rows_matches_reference(dtype):
    g = torch.Generator().manual_seed(4)
    vectors = torch.full((2000,), float("nan"), device=DEVICE)
    vectors[100:400] = torch.rand(300, generator=g).to(DEVICE) + 0.5
    vectors[1024:1324] = torch.rand(300, generator=g).to(DEVICE) + 0.5
    scale_at = torch.tensor([-1, -1, 100, 1024], dtype=torch.int64, device=DEVICE)
    x = torch.randn(6, 300, generator=g).to(DEVICE, dtype)
    slots = torch.tensor([0, 2, 3, 1, 2, 0], dtype=torch.int32, device=DEVICE)
    with poisoned_allocations(famp):
        out = famp.scale_rows_paged(guarded_rows(x), vectors, scale_at, slots)
    torch.testing.assert_close(out, ref.scale_rows_paged(x, vectors, scale_at, slots), atol=1e-3, rtol=1e-3)
    assert torch.equal(out[0], x[0]) and torch.equal(out[3], x[3])


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("per_slice", [False, True])
def test_paged_flora_stack_and_combine_match_the_slot_kernels(dtype, per_slice):
    x, a, flora_b, slots, fr, rows, bounds, offsets = _flora_case(dtype, num_padding=3)
    pool, paged = _page(a, flora_b, fr, offsets)
    weights, num_rows = pool.view(dtype), 11
    with poisoned_allocations(famp):
        stacked = famp.flora_stack_paged(guarded_rows(x), weights, paged.a_pages, fr, *rows, per_slice)
    want = ref.flora_stack(x, a, fr, *rows, per_slice)
    torch.testing.assert_close(stacked, want, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(ref.flora_stack_paged(x, weights, paged.a_pages, fr, *rows, per_slice), want,
                               atol=1e-6, rtol=1e-5)
    g = torch.Generator().manual_seed(6)
    w0 = torch.randn(offsets[-1], 40, generator=g).to(DEVICE, dtype)
    bias = torch.randn(offsets[-1], generator=g).to(DEVICE, dtype)
    products = _slice_products(want, w0, offsets, per_slice, 6)
    with poisoned_allocations(famp):
        out = famp.flora_combine_paged(products, weights, paged.b_pages, slots, fr, bounds, offsets, num_rows,
                                       per_slice, bias)
    expected = ref.flora_combine(products, flora_b, slots, fr, bounds, offsets, num_rows, per_slice, bias)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    paged_ref = ref.flora_combine_paged(products, weights, paged.b_pages, slots, fr, bounds, offsets,
                                        num_rows, per_slice, bias)
    torch.testing.assert_close(paged_ref, expected, atol=1e-6, rtol=1e-5)


def test_the_paged_references_follow_only_the_slots_a_call_uses():
    """The engine's tables have a row for every slot (hundreds on a small model); the CPU path
    (these references) gathers only the rows that the call's tokens name: the others' entries,
    pointing far past the pool here, are never followed, and the results are the same. (On the CPU
    on every machine: a GPU would assert on the device where the CPU raises IndexError.)"""
    a, b, ranks, offsets, pool, paged = _lora_case(RANKS, 40, (24, 8, 16), 8, torch.float32, device="cpu")
    scale, scaled, _ = _scales(len(RANKS), offsets[-1], (1, 3), False, "cpu")
    _, scaled_paged = _page(a, b.transpose(1, 2), ranks, offsets, scale, None, scaled.tolist())
    weights, vectors = pool.view(torch.float32), pool.view(torch.float32)
    g = torch.Generator().manual_seed(8)
    x, y = torch.randn(4, 40, generator=g), torch.randn(4, offsets[-1], generator=g)
    slots = torch.tensor([2, 0, 2, 1], dtype=torch.int32)  # slot 3 unused
    far = 10**12
    a_pages, b_pages = paged.a_pages.clone(), paged.b_pages.clone()
    a_pages[3], b_pages[3] = far, far
    scale_at = scaled_paged.scale_at.clone()
    scale_at[3] = far
    shrunk = ref.lora_shrink_paged(x, weights, a_pages, slots, ranks, 8)
    torch.testing.assert_close(shrunk, ref.lora_shrink(x, a, slots, ranks))
    out = ref.lora_expand_paged(y.clone(), shrunk, weights, b_pages, slots, ranks, offsets)
    torch.testing.assert_close(out, ref.lora_expand(y.clone(), shrunk, b, slots, ranks, offsets))
    scaled_out = ref.scale_rows_paged(x, vectors, scale_at, slots)
    assert torch.equal(scaled_out[1], x[1])  # slot 0: unscaled
    with pytest.raises(IndexError):  # (the same call naming slot 3 does follow its rows)
        ref.lora_shrink_paged(x, weights, a_pages, torch.tensor([3, 0, 1, 2], dtype=torch.int32), ranks, 8)


def test_paged_wrappers_reject_bad_tables():
    *_, ranks, offsets, pool, paged = _lora_case(RANKS, 40, (24, 8, 16), 8, torch.float32)
    x = torch.randn(3, 40, device=DEVICE)
    slots = torch.tensor([1, 2, 3], dtype=torch.int32, device=DEVICE)
    weights = pool.view(torch.float32)
    with pytest.raises(ValueError, match="a_pages"):
        lora_paged.lora_shrink_paged(x, weights, paged.a_pages.to(torch.int32), slots, ranks, 8)
    with pytest.raises(ValueError, match="a_pages"):  # tables for max rank 8, asked for 16
        lora_paged.lora_shrink_paged(x, weights, paged.a_pages, slots, ranks, 16)
    with pytest.raises(ValueError, match="pool"):
        lora_paged.lora_shrink_paged(x, pool, paged.a_pages, slots, ranks, 8)
    shrunk = torch.zeros(3, 3, 8, device=DEVICE)
    y = torch.randn(3, offsets[-1], device=DEVICE)
    with pytest.raises(ValueError, match="scale_at"):
        lora_paged.lora_expand_paged(y, shrunk, weights, paged.b_pages, slots, ranks, offsets,
                                     scale_at=paged.scale_at)


@gpu
@skip_without_cuda
@pytest.mark.parametrize("projection", ["qkv", "o", "gate_up", "down"])
@pytest.mark.parametrize("num_tokens", [1, 64, 600])
def test_paged_lora_bf16_llama_matches_the_slot_kernels(projection, num_tokens):
    """Llama-3-8B shapes in bf16, 64 adapters of ranks 8 to 64: the paged kernels agree with the
    slot kernels on the same weights (both sum in float32 over the same rows)."""
    in_features, sizes = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)),
                          "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}[projection]
    g = random.Random(num_tokens)
    ranks = [[0] * len(sizes)] + [[g.choice((8, 16, 32, 64))] * len(sizes) for _ in range(64)]
    a, b, ranks_t, offsets = _slot_buffers(ranks, in_features, sizes, 64, torch.bfloat16, DEVICE)
    pool, paged = _page(a, b.transpose(1, 2), ranks_t, offsets, num_pages=400, page_bytes=2 << 20)
    slots = torch.tensor([1 + i % 64 for i in range(num_tokens)], dtype=torch.int32, device=DEVICE)
    x = torch.randn(num_tokens, in_features, device=DEVICE, dtype=torch.bfloat16)
    y = torch.randn(num_tokens, offsets[-1], device=DEVICE, dtype=torch.bfloat16)
    shrunk = lora_paged.lora_shrink_paged(x, pool.view(torch.bfloat16), paged.a_pages, slots, ranks_t, 64)
    out = lora_paged.lora_expand_paged(y.clone(), shrunk, pool.view(torch.bfloat16), paged.b_pages, slots,
                                       ranks_t, offsets)
    want_shrunk = lora.lora_shrink(x, a, slots, ranks_t)
    want = lora.lora_expand(y.clone(), want_shrunk, b, slots, ranks_t, offsets)
    torch.testing.assert_close(shrunk, want_shrunk, atol=1e-2, rtol=1e-2)
    assert_close_bf16(out, want, atol=6e-2, rtol=2e-2)

import pytest
import torch

from loraplex.kernels import lora
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


def _slot_buffers(ranks, in_features, slice_sizes, max_rank, dtype, device, seed=0):
    """A [num_slots, num_slices, max_rank, in] and B [num_slots, out, max_rank] holding random
    weights up to each (slot, slice)'s rank and NaN everywhere else (slot 0, rank padding):
    a kernel that reads past a rank, or reads slot 0, produces NaN."""
    g = torch.Generator().manual_seed(seed)
    num_slots, num_slices = len(ranks), len(slice_sizes)
    offsets = [0]
    for size in slice_sizes:
        offsets.append(offsets[-1] + size)
    a = torch.full((num_slots, num_slices, max_rank, in_features), float("nan"))
    b = torch.full((num_slots, offsets[-1], max_rank), float("nan"))
    for slot in range(1, num_slots):
        for s, r in enumerate(ranks[slot]):
            a[slot, s, :r] = torch.randn(r, in_features, generator=g) / in_features ** 0.5
            b[slot, offsets[s]:offsets[s + 1], :r] = torch.randn(slice_sizes[s], r, generator=g)
    ranks_t = torch.tensor(ranks, dtype=torch.int32)
    return a.to(device, dtype), b.to(device, dtype), ranks_t.to(device), tuple(offsets)


# Slot 0 (no adapter) claims rank 8 over NaN weights: it must be skipped by slot, not rank.
RANKS = [[8, 8, 8], [4, 0, 8], [8, 8, 8], [1, 3, 2]]  # a rank-0 slice; mixed ranks


def _run_both(x, a, b, slots, ranks, offsets, y):
    with poisoned_allocations(lora):
        shrunk = lora.lora_shrink(x, a, slots, ranks)
        out = lora.lora_expand(y, shrunk, b, slots, ranks, offsets)
    return shrunk, out


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("path", ["gemv", "tiles"])
def test_shrink_expand_match_reference_mixed_slots_and_ranks(dtype, path, monkeypatch):
    if path == "tiles":  # force the tl.dot path (BLOCK_M > 1) at this tiny batch
        monkeypatch.setattr(lora, "MAX_GEMV_TOKENS", 2)
    a, b, ranks, offsets = _slot_buffers(RANKS, 40, (24, 8, 16), 8, dtype, DEVICE)
    g = torch.Generator().manual_seed(1)
    slot_list = [0, 2, 1, 2, 0, 3, 1, 1, 2]
    x = torch.randn(len(slot_list), 40, generator=g).to(DEVICE, dtype)
    y = torch.randn(len(slot_list), offsets[-1], generator=g).to(DEVICE, dtype)
    slots = guarded_1d(torch.tensor(slot_list, dtype=torch.int32, device=DEVICE))
    xg, yg = guarded_rows(x), guarded_rows(y)
    shrunk, out = _run_both(xg, a, b, slots, ranks, offsets, yg)
    expected_shrunk = ref.lora_shrink(x, a, slots, ranks)
    expected_y = ref.lora_expand(y.clone(), expected_shrunk, b, slots, ranks, offsets)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(shrunk, expected_shrunk, atol=tol, rtol=tol)
    assert out is yg  # in place
    torch.testing.assert_close(out, expected_y, atol=tol, rtol=tol)
    untouched = torch.tensor(slot_list, device=DEVICE) == 0
    assert torch.equal(out[untouched], y[untouched])


def test_shrink_tile_path_splits_k_with_atomics_and_matches_reference(monkeypatch):
    monkeypatch.setattr(lora, "MAX_GEMV_TOKENS", 1)
    ranks = [[0], [16], [5]]
    a, b, ranks_t, offsets = _slot_buffers(ranks, 512, (32,), 16, torch.float32, DEVICE, seed=2)
    x = torch.randn(2, 512, device=DEVICE)
    slots = torch.tensor([2, 1], dtype=torch.int32, device=DEVICE)
    config = lora.shrink_config(2, 1, 512, 16, DEVICE)
    assert config.block_m > 1 and config.k_splits > 1
    shrunk = lora.lora_shrink(x, a, slots, ranks_t)
    torch.testing.assert_close(shrunk, ref.lora_shrink(x, a, slots, ranks_t), atol=1e-5, rtol=1e-5)


def test_decode_shrink_writes_every_element_without_a_zero_fill(monkeypatch):
    """The per-token shrink owns each output element: no torch.zeros launch before it, and
    every element written (its output comes from a poisoned torch.empty)."""
    def no_zeros(*args, **kwargs):
        raise AssertionError("the per-token shrink must not zero-fill its output")

    a, _, ranks, _ = _slot_buffers(RANKS, 40, (24, 8, 16), 8, torch.float32, DEVICE)
    x = torch.randn(5, 40, device=DEVICE)
    slots = torch.tensor([3, 0, 1, 2, 3], dtype=torch.int32, device=DEVICE)
    assert lora.shrink_config(5, 3, 40, 8, DEVICE).block_m == 1
    with poisoned_allocations(lora):
        monkeypatch.setattr(lora.torch, "zeros", no_zeros, raising=False)
        shrunk = lora.lora_shrink(x, a, slots, ranks)
    torch.testing.assert_close(shrunk, ref.lora_shrink(x, a, slots, ranks), atol=1e-5, rtol=1e-5)


def _check_both_paths(path, monkeypatch, ranks, in_features, slice_sizes, max_rank, slot_list,
                      dtype=torch.float32, seed=0):
    if path == "tiles":
        monkeypatch.setattr(lora, "MAX_GEMV_TOKENS", 1)
    a, b, ranks_t, offsets = _slot_buffers(ranks, in_features, slice_sizes, max_rank, dtype,
                                           DEVICE, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(len(slot_list), in_features, generator=g).to(DEVICE, dtype)
    y = torch.randn(len(slot_list), offsets[-1], generator=g).to(DEVICE, dtype)
    slots = guarded_1d(torch.tensor(slot_list, dtype=torch.int32, device=DEVICE))
    shrunk, out = _run_both(guarded_rows(x), a, b, slots, ranks_t, offsets, guarded_rows(y))
    expected_shrunk = ref.lora_shrink(x, a, slots, ranks_t)
    expected_y = ref.lora_expand(y.clone(), expected_shrunk, b, slots, ranks_t, offsets)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(shrunk, expected_shrunk, atol=tol, rtol=tol)
    torch.testing.assert_close(out, expected_y, atol=tol, rtol=tol)
    return out, y


@pytest.mark.parametrize("path", ["gemv", "tiles"])
def test_many_tokens_per_adapter_in_runs_and_interleaved(path, monkeypatch):
    slot_list = [1] * 9 + [2] * 7 + [0, 2, 1, 2, 0, 1, 1, 2]
    out, y = _check_both_paths(path, monkeypatch, [[0, 0], [8, 4], [6, 8]], 32, (16, 16), 8,
                               slot_list)
    changed = (out != y).any(dim=1).cpu()
    assert changed.tolist() == [s != 0 for s in slot_list]


@pytest.mark.parametrize("path", ["gemv", "tiles"])
@pytest.mark.parametrize("in_features", [48, 64])  # a ragged last K step, and none
def test_mixed_ranks_1_8_16_64_in_rank_64_slots(path, in_features, monkeypatch):
    """Slots of max_rank 64 holding ranks 1, 8, 16 and 64 (NaN padding past each rank)."""
    ranks = [[64, 64], [1, 8], [16, 64], [64, 1], [8, 16]]
    _check_both_paths(path, monkeypatch, ranks, in_features, (24, 40), 64, [4, 1, 3, 0, 2, 1],
                      seed=3)


def test_max_rank_not_a_multiple_of_the_rank_chunk(monkeypatch):
    _check_both_paths("gemv", monkeypatch, [[0], [24], [17], [3]], 32, (40,), 24, [1, 2, 3, 1],
                      seed=4)


SHRINK_CPU = [*lora.CANDIDATE_SHRINK_CONFIGS, lora.ShrinkConfig(32, 16, 16, 2, 4)]
EXPAND_CPU = [*lora.CANDIDATE_EXPAND_CONFIGS, lora.ExpandConfig(1, 16, 4),
              lora.ExpandConfig(32, 16, 4), lora.ExpandConfig(16, 32, 4)]


@pytest.mark.parametrize("config", SHRINK_CPU, ids=str)
def test_shrink_launch_configs_match_reference(config):
    a, _, ranks, _ = _slot_buffers(RANKS, 40, (24, 8, 16), 8, torch.float32, DEVICE, seed=6)
    x = guarded_rows(torch.randn(4, 40, device=DEVICE))
    slots = torch.tensor([2, 3, 0, 1], dtype=torch.int32, device=DEVICE)
    with poisoned_allocations(lora):
        shrunk = lora._launch_shrink(x, a, slots, ranks, config)
    torch.testing.assert_close(shrunk, ref.lora_shrink(x, a, slots, ranks), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("config", EXPAND_CPU, ids=str)
def test_expand_launch_configs_match_reference_across_slice_bounds(config):
    """Column tiles of 16 and 32 straddle the slice bounds 24 and 32; wider ones hold all."""
    a, b, ranks, offsets = _slot_buffers(RANKS, 16, (24, 8, 16), 8, torch.float32, DEVICE, seed=7)
    slots = torch.tensor([2, 3, 0, 1, 2], dtype=torch.int32, device=DEVICE)
    shrunk = ref.lora_shrink(torch.randn(5, 16, device=DEVICE), a, slots, ranks)
    y = torch.randn(5, offsets[-1], device=DEVICE)
    expected = ref.lora_expand(y.clone(), shrunk, b, slots, ranks, offsets)
    out = lora._launch_expand(guarded_rows(y), shrunk, b, slots, ranks, list(offsets), config)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_all_tokens_without_adapter_leave_y_alone():
    a, b, ranks, offsets = _slot_buffers(RANKS, 16, (16, 16, 16), 8, torch.float32, DEVICE)
    x = torch.randn(3, 16, device=DEVICE)
    y = torch.randn(3, 48, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    shrunk, out = _run_both(x, a, b, slots, ranks, offsets, y.clone())
    assert torch.equal(shrunk, torch.zeros_like(shrunk))
    assert torch.equal(out, y)


def test_wrapper_rejects_bad_inputs():
    a, b, ranks, offsets = _slot_buffers(RANKS, 16, (16, 16, 16), 8, torch.float32, DEVICE)
    x = torch.randn(3, 16, device=DEVICE)
    slots = torch.ones(3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="lora_a"):
        lora.lora_shrink(x, a[..., :8], slots, ranks)
    with pytest.raises(ValueError, match="ranks"):
        lora.lora_shrink(x, a, slots, ranks[:, :2])
    with pytest.raises(ValueError, match="token_slots"):
        lora.lora_shrink(x, a, slots[:2], ranks)
    shrunk = lora.lora_shrink(x, a, slots, ranks)
    y = torch.zeros(3, 48, device=DEVICE)
    with pytest.raises(ValueError, match="slice_offsets"):
        lora.lora_expand(y, shrunk, b, slots, ranks, (0, 8, 16, 24, 32, 48))
    with pytest.raises(ValueError, match="slice_offsets"):
        lora.lora_expand(y, shrunk, b, slots, ranks, (0, 40, 32, 48))
    with pytest.raises(ValueError, match="shrunk"):
        lora.lora_expand(y, shrunk.half(), b, slots, ranks, offsets)


# Llama-3-8B projection groups: (in_features, slice sizes).
PROJECTIONS = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)),
               "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}
MIXED_RANKS = (1, 8, 16, 64)


@gpu
@skip_without_cuda
@pytest.mark.parametrize("projection,num_tokens,num_adapters", [
    ("qkv", 64, 64), ("qkv", 256, 8), ("qkv", 2048, 3), ("o", 64, 64), ("gate_up", 64, 64),
    ("down", 64, 64), ("down", 1024, 16)])
def test_lora_bf16_llama(projection, num_tokens, num_adapters):
    """Ranks 1, 8, 16 and 64 mixed in max_rank-64 slots (NaN padding), one rank-0 slice."""
    in_features, slice_sizes = PROJECTIONS[projection]
    g = torch.Generator().manual_seed(num_tokens)
    num_slots, num_slices = num_adapters + 1, len(slice_sizes)
    ranks = [[0] * num_slices] + [[MIXED_RANKS[(i + s) % 4] for s in range(num_slices)]
                                  for i in range(num_adapters)]
    ranks[1][-1] = 0
    a, b, ranks_t, offsets = _slot_buffers(ranks, in_features, slice_sizes, 64, torch.bfloat16,
                                           "cuda")
    slots = torch.randint(0, num_slots, (num_tokens,), generator=g)
    if num_tokens <= num_adapters:  # decode: distinct adapters, and slot 0
        slots = torch.randperm(num_slots, generator=g)[:num_tokens]
    elif num_tokens > 1024:  # prefill chunks: runs of one adapter
        slots = torch.arange(num_tokens) * num_slots // num_tokens
    slots = slots.to(torch.int32).cuda()
    x = torch.randn(num_tokens, in_features, generator=g).to("cuda", torch.bfloat16)
    y = torch.randn(num_tokens, offsets[-1], generator=g).to("cuda", torch.bfloat16)
    shrunk = lora.lora_shrink(x, a, slots, ranks_t)
    expected_shrunk = ref.lora_shrink(x.float(), a.float(), slots, ranks_t)
    assert_close_bf16(shrunk, expected_shrunk, atol=6e-2, rtol=6e-2)
    expected_y = ref.lora_expand(y.float(), expected_shrunk, b.float(), slots, ranks_t, offsets)
    out = lora.lora_expand(y, shrunk, b, slots, ranks_t, offsets)
    assert_close_bf16(out, expected_y, atol=6e-2, rtol=6e-2)


_SHRINKS, _EXPANDS = lora.CANDIDATE_SHRINK_CONFIGS, lora.CANDIDATE_EXPAND_CONFIGS
_TILED = [*lora.CANDIDATE_TILE_CONFIGS,
          (lora.ShrinkConfig(32, 16, 128, 1, 4), lora.ExpandConfig(32, 128, 4))]


@gpu
@skip_without_cuda
@pytest.mark.parametrize("shrink,expand", [
    *((s, _EXPANDS[i % len(_EXPANDS)]) for i, s in enumerate(_SHRINKS)), *_TILED], ids=str)
def test_lora_bf16_candidate_configs(shrink, expand):
    g = torch.Generator().manual_seed(5)
    ranks = [[0, 0, 0]] + [[16, 16, 16]] * 63 + [[8, 0, 16]]
    a, b, ranks_t, offsets = _slot_buffers(ranks, 4096, (4096, 1024, 1024), 16, torch.bfloat16,
                                           "cuda")
    slots = (torch.randperm(65, generator=g)[:64]).to(torch.int32).cuda()  # includes slot 0
    x = torch.randn(64, 4096, generator=g).to("cuda", torch.bfloat16)
    y = torch.randn(64, 6144, generator=g).to("cuda", torch.bfloat16)
    with poisoned_allocations(lora):
        shrunk = lora._launch_shrink(x, a, slots, ranks_t, shrink)
    expected_shrunk = ref.lora_shrink(x.float(), a.float(), slots, ranks_t)
    assert_close_bf16(shrunk, expected_shrunk, atol=6e-2, rtol=6e-2)
    expected_y = ref.lora_expand(y.float(), expected_shrunk, b.float(), slots, ranks_t, offsets)
    out = lora._launch_expand(y, shrunk, b, slots, ranks_t, list(offsets), expand)
    assert_close_bf16(out, expected_y, atol=6e-2, rtol=6e-2)

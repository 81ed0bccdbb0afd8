"""The DoRA / IA3 epilogue of the LoRA expand, IA3's input scaling and FLoRA's row stacking and
combining against kernels/reference.py: under the interpreter in float32 and float16 on the
CPU, in bf16 on the GPU. Weights past each rank, slot 0 and guard regions hold NaN."""

import pytest
import torch

from loraplex.kernels import adapter_families as fam
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
from tests.kernels.test_lora_kernel import RANKS, _slot_buffers

SLOTS = [0, 2, 1, 2, 0, 3, 1, 1, 2]
PAD_RANK = 1 << 30  # the rank of a padding FLoRA row (as the step inputs pad a decode graph's)
SLICES = (24, 8, 16)


def _scales(num_slots, out, scaled_slots, with_shift, device, seed=3):
    g = torch.Generator().manual_seed(seed)
    scale = torch.full((num_slots, out), float("nan"))  # unscaled slots' rows are never read
    shift = torch.full((num_slots, out), float("nan")) if with_shift else None
    scaled = torch.zeros(num_slots, dtype=torch.int32)
    for slot in scaled_slots:
        scale[slot] = 1 + 0.3 * torch.randn(out, generator=g)
        if with_shift:
            shift[slot] = torch.randn(out, generator=g)
        scaled[slot] = 1
    to = (lambda t: None if t is None else t.to(device))
    return to(scale), to(scaled), to(shift)


def _check_epilogue(dtype, path, with_shift, monkeypatch, scaled_slots=(1, 3)):
    if path == "tiles":
        monkeypatch.setattr(lora, "MAX_GEMV_TOKENS", 2)
    a, b, ranks, offsets = _slot_buffers(RANKS, 40, SLICES, 8, dtype, DEVICE)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(SLOTS), 40, generator=g).to(DEVICE, dtype)
    y = torch.randn(len(SLOTS), offsets[-1], generator=g).to(DEVICE, dtype)
    slots = guarded_1d(torch.tensor(SLOTS, dtype=torch.int32, device=DEVICE))
    scale, scaled, shift = _scales(len(RANKS), offsets[-1], scaled_slots, with_shift, DEVICE)
    shrunk = ref.lora_shrink(x, a, slots, ranks)
    out = lora.lora_expand(guarded_rows(y), shrunk, b, slots, ranks, offsets, scale, scaled, shift)
    expected = ref.lora_expand(y.clone(), shrunk, b, slots, ranks, offsets, scale, scaled, shift)
    return out, expected, y


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("path", ["gemv", "tiles"])
@pytest.mark.parametrize("with_shift", [False, True])
def test_dora_epilogue_matches_reference(dtype, path, with_shift, monkeypatch):
    out, expected, y = _check_epilogue(dtype, path, with_shift, monkeypatch)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    untouched = torch.tensor(SLOTS, device=DEVICE) == 0
    assert torch.equal(out[untouched], y[untouched])
    # The scale did something: slot 1's rows differ from the unscaled expand.
    plain = ref.lora_expand(y.clone(), ref.lora_shrink(*_inputs(dtype)), *_weights(dtype)[1:])
    assert not torch.allclose(out[2], plain[2], atol=1e-2)


def _weights(dtype):
    a, b, ranks, offsets = _slot_buffers(RANKS, 40, SLICES, 8, dtype, DEVICE)
    slots = torch.tensor(SLOTS, dtype=torch.int32, device=DEVICE)
    return a, b, slots, ranks, offsets


def _inputs(dtype):
    a, _, slots, ranks, _ = _weights(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(SLOTS), 40, generator=g).to(DEVICE, dtype)
    return x, a, slots, ranks


def test_ia3_output_scale_on_a_slot_of_rank_zero(monkeypatch):
    """IA3's vectors ride the expand with no rank at all: y <- scale * y for its tokens."""
    ranks = [[8, 8, 8], [0, 0, 0], [2, 2, 2]]
    a, b, ranks_t, offsets = _slot_buffers(ranks, 40, SLICES, 8, torch.float32, DEVICE)
    slots = torch.tensor([1, 2, 0, 1], dtype=torch.int32, device=DEVICE)
    y = torch.randn(4, offsets[-1], device=DEVICE)
    x = torch.randn(4, 40, device=DEVICE)
    scale, scaled, _ = _scales(3, offsets[-1], (1,), False, DEVICE)
    shrunk = ref.lora_shrink(x, a, slots, ranks_t)
    out = lora.lora_expand(y.clone(), shrunk, b, slots, ranks_t, offsets, scale, scaled)
    torch.testing.assert_close(out[[0, 3]], y[[0, 3]] * scale[1], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out, ref.lora_expand(y.clone(), shrunk, b, slots, ranks_t, offsets, scale,
                                                    scaled), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
def test_scale_rows_matches_reference(dtype):
    g = torch.Generator().manual_seed(4)
    scales = torch.ones(4, 300)
    scales[2] = torch.rand(300, generator=g) + 0.5
    scales[3] = torch.rand(300, generator=g) + 0.5
    x = torch.randn(6, 300, generator=g).to(DEVICE, dtype)
    slots = torch.tensor([0, 2, 3, 1, 2, 0], dtype=torch.int32, device=DEVICE)
    out = fam.scale_rows(guarded_rows(x), scales.to(DEVICE), slots)
    torch.testing.assert_close(out, ref.scale_rows(x, scales.to(DEVICE), slots), atol=1e-3, rtol=1e-3)
    assert torch.equal(out[0], x[0])


def _flora_case(dtype, seed=5, num_padding=0):
    """Slots: 1 FLoRA of rank 3 on slices 0 and 2, 2 FLoRA of rank 1 on every slice; tokens of
    slot 0 and a plain slot (3, FLoRA rank 0) between them. `num_padding` padding rows after
    the real ones (as a decode graph pads them: token 0, a rank past every slot's)."""
    flora = [[8, 8, 8], [3, 0, 3], [1, 1, 1], [0, 0, 0]]
    a, b, fr, offsets = _slot_buffers(flora, 40, SLICES, 8, dtype, DEVICE, seed=seed)
    slot_list = [1, 0, 2, 3, 1, 2]
    slots = torch.tensor(slot_list, dtype=torch.int32, device=DEVICE)
    rank_of = {1: 3, 2: 1}
    row_tokens = [t for t, s in enumerate(slot_list) for _ in range(rank_of.get(s, 0))]
    row_ranks = [k for s in slot_list for k in range(rank_of.get(s, 0))]
    bounds = [0]
    for s in slot_list:
        bounds.append(bounds[-1] + rank_of.get(s, 0))
    row_tokens += [0] * num_padding
    row_ranks += [PAD_RANK] * num_padding
    as_t = (lambda v: torch.tensor(v, dtype=torch.int64, device=DEVICE))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(slot_list), 40, generator=g).to(DEVICE, dtype)
    return x, a, b, slots, fr, as_t(row_tokens), as_t(row_ranks), as_t(bounds), offsets


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("num_padding", [0, 5])
def test_flora_stack_and_combine_match_reference_and_the_explicit_product(dtype, num_padding):
    x, a, b, slots, fr, row_tokens, row_ranks, bounds, offsets = _flora_case(dtype, num_padding=num_padding)
    num_rows = 8 + num_padding
    with poisoned_allocations(fam):
        stacked = fam.flora_stack(guarded_rows(x), a, slots, fr, row_tokens, row_ranks)
    expected = ref.flora_stack(x, a, slots, fr, row_tokens, row_ranks)
    assert stacked.shape == (6 + 3 * num_rows, 40)
    torch.testing.assert_close(stacked, expected, atol=1e-3, rtol=1e-3)
    assert torch.equal(stacked[:6], x)
    for s in range(3):  # padding rows are zero
        assert not stacked[6 + s * num_rows + 8:6 + (s + 1) * num_rows].any()
    g = torch.Generator().manual_seed(6)
    w0 = torch.randn(offsets[-1], 40, generator=g).to(DEVICE, dtype)
    bias = torch.randn(offsets[-1], generator=g).to(DEVICE, dtype)
    products = ref.linear(expected, w0)
    y = ref.linear(x, w0, bias)
    out = fam.flora_combine(guarded_rows(y), products[6:], b, slots, fr, row_ranks, bounds, offsets, bias)
    want = ref.flora_combine(y.clone(), products[6:], b, slots, fr, row_ranks, bounds, offsets, bias)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    # The oracle: token 0 (slot 1) through W0 * (B A) on slices 0 and 2, W0 on slice 1.
    w = w0.float().clone()
    for s in (0, 2):
        lo, hi = offsets[s], offsets[s + 1]
        w[lo:hi] *= b[1, lo:hi, :3].float() @ a[1, s, :3].float()
    explicit = x[0].float() @ w.T + bias.float()
    torch.testing.assert_close(out[0].float(), explicit, atol=tol * 10, rtol=tol * 10)
    for t in (1, 3):  # no adapter, a non-FLoRA slot: untouched
        assert torch.equal(out[t], y[t])


@gpu
@skip_without_cuda
def test_families_bf16_on_gpu(monkeypatch):
    out, expected, _ = _check_epilogue(torch.bfloat16, "gemv", True, monkeypatch)
    assert_close_bf16(out, expected, atol=6e-2, rtol=6e-2)
    x, a, b, slots, fr, row_tokens, row_ranks, bounds, offsets = _flora_case(torch.bfloat16, num_padding=8)
    stacked = fam.flora_stack(x, a, slots, fr, row_tokens, row_ranks)
    assert_close_bf16(stacked, ref.flora_stack(x, a, slots, fr, row_tokens, row_ranks), atol=1e-2, rtol=1e-2)
    w0 = torch.randn(offsets[-1], 40, device=DEVICE, dtype=torch.bfloat16)
    products = ref.linear(stacked, w0)
    y = ref.linear(x, w0)
    out = fam.flora_combine(y.clone(), products[6:], b, slots, fr, row_ranks, bounds, offsets)
    assert_close_bf16(out, ref.flora_combine(y.clone(), products[6:], b, slots, fr, row_ranks, bounds,
                                             offsets), atol=6e-2, rtol=6e-2)


@gpu
@skip_without_cuda
def test_flora_bf16_llama_shapes():
    """Llama-3-8B's qkv at batch 16, FLoRA rank 4 on every token, 64 rows (a graph's bucket)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    num_tokens, rank, hidden, offsets = 16, 4, 4096, (0, 4096, 5120, 6144)
    a = torch.randn(9, 3, 16, hidden, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(9, offsets[-1], 16, device="cuda", generator=g).to(torch.bfloat16)
    fr = torch.full((9, 3), rank, dtype=torch.int32, device="cuda")
    slots = torch.arange(num_tokens, device="cuda", dtype=torch.int32) % 8 + 1
    row_tokens = torch.arange(num_tokens, device="cuda").repeat_interleave(rank)
    row_ranks = torch.arange(rank, device="cuda").repeat(num_tokens)
    bounds = torch.arange(num_tokens + 1, device="cuda") * rank
    x = torch.randn(num_tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    stacked = fam.flora_stack(x, a, slots, fr, row_tokens, row_ranks)
    assert_close_bf16(stacked, ref.flora_stack(x, a, slots, fr, row_tokens, row_ranks), atol=1e-2, rtol=1e-2)
    w0 = torch.randn(offsets[-1], hidden, device="cuda", generator=g).to(torch.bfloat16) / 64
    products = ref.linear(stacked, w0)
    y = products[:num_tokens].clone()
    out = fam.flora_combine(y.clone(), products[num_tokens:], b, slots, fr, row_ranks, bounds, offsets)
    want = ref.flora_combine(y.clone(), products[num_tokens:], b, slots, fr, row_ranks, bounds, offsets)
    assert_close_bf16(out, want, atol=6e-2, rtol=6e-2)

import pytest
import torch

from loraplex.kernels import activation
from loraplex.kernels import reference as ref
from tests.kernels.kernel_testing import (
    DEVICE,
    INTERPRETER_DTYPES,
    as_pool_offsets,
    assert_close_bf16,
    gpu,
    guarded_1d,
    guarded_rows,
    poisoned_allocations,
    skip_without_cuda,
)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("intermediate", [40, 1100])  # one partial block; several blocks
def test_silu_and_mul_matches_reference(dtype, intermediate):
    g = torch.Generator().manual_seed(intermediate)
    x = (torch.randn(3, 2 * intermediate, generator=g) * 4).to(DEVICE, dtype)
    with poisoned_allocations(activation):
        out = activation.silu_and_mul(guarded_rows(x))
    expected = ref.silu_and_mul(x)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_wrapper_rejects_bad_inputs():
    with pytest.raises(ValueError, match="even"):
        activation.silu_and_mul(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="dims"):
        activation.silu_and_mul(torch.zeros(8, device=DEVICE))


@gpu
@skip_without_cuda
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_silu_and_mul_bf16_llama_shapes(num_tokens):
    x = torch.randn(num_tokens, 2 * 14336, device="cuda", dtype=torch.bfloat16) * 4
    out = activation.silu_and_mul(x)
    assert_close_bf16(out, ref.silu_and_mul(x.float()), atol=2e-2, rtol=1e-2)


def _ia3(num_slots, intermediate, out_slots, in_slots, device, seed=2):
    """IA3 vectors: gate | up [num_slots, 2 * intermediate] for out_slots, the down input
    [num_slots, intermediate] for in_slots (NaN where no flag is set: never read)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.full((num_slots, 2 * intermediate), float("nan"))
    in_scale = torch.full((num_slots, intermediate), float("nan"))
    scaled = torch.zeros(num_slots, dtype=torch.int32)
    in_scaled = torch.zeros(num_slots, dtype=torch.int32)
    for slot in out_slots:
        scale[slot], scaled[slot] = 1 + 0.5 * torch.randn(2 * intermediate, generator=g), 1
    for slot in in_slots:
        in_scale[slot], in_scaled[slot] = 1 + 0.5 * torch.randn(intermediate, generator=g), 1
    return [t.to(device) for t in (scale, scaled, in_scale, in_scaled)]


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
def test_silu_and_mul_applies_ia3_vectors(dtype):
    """Slot 1 scales gate | up and the result, 2 only the result (PEFT's default: down_proj's
    input), 3 only gate | up; slot 0 and 4 nothing."""
    intermediate = 1100
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(6, 2 * intermediate, generator=g) * 4).to(DEVICE, dtype)
    token_slots = torch.tensor([0, 1, 2, 3, 4, 1], dtype=torch.int32, device=DEVICE)
    ia3 = _ia3(5, intermediate, (1, 3), (1, 2), DEVICE)
    with poisoned_allocations(activation):
        out = activation.silu_and_mul(guarded_rows(x), guarded_1d(token_slots), *ia3)
    expected = ref.silu_and_mul(x, token_slots, *ia3)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    # The oracle, by hand: rows 0 and 4 as the plain op; row 2 the plain op times the vector.
    plain = ref.silu_and_mul(x)
    torch.testing.assert_close(out[[0, 4]], plain[[0, 4]], atol=tol, rtol=tol)
    scale, _, in_scale, _ = ia3
    torch.testing.assert_close(out[2], (plain[2].float() * in_scale[2]).to(dtype), atol=tol, rtol=tol)
    gate_up = (x[3].float() * scale[3]).to(dtype)
    torch.testing.assert_close(out[3], ref.silu_and_mul(gate_up[None])[0], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
def test_silu_and_mul_reads_ia3_vectors_at_pool_offsets(dtype):
    """Paged adapters: gate | up's and down's input vectors at int64 offsets of one pool (-1:
    none) give exactly what the same vectors as dense rows give, kernel and reference."""
    intermediate = 1100
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(6, 2 * intermediate, generator=g) * 4).to(DEVICE, dtype)
    token_slots = torch.tensor([0, 1, 2, 3, 4, 1], dtype=torch.int32, device=DEVICE)
    scale, scaled, in_scale, in_scaled = _ia3(5, intermediate, (1, 3), (1, 2), DEVICE)
    out_pool, out_at = as_pool_offsets(scale, scaled, seed=1)
    in_pool, in_at = as_pool_offsets(in_scale, in_scaled, seed=2)
    pool = torch.cat([out_pool, in_pool])  # one pool, as the adapters' pages are
    in_at = torch.where(in_at >= 0, in_at + len(out_pool), in_at)
    dense = activation.silu_and_mul(x, token_slots, scale, scaled, in_scale, in_scaled)
    with poisoned_allocations(activation):
        paged = activation.silu_and_mul(guarded_rows(x), guarded_1d(token_slots), pool, guarded_1d(out_at),
                                        pool, guarded_1d(in_at))
    assert torch.equal(paged, dense)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(paged, ref.silu_and_mul(x, token_slots, pool, out_at, pool, in_at),
                               atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="both int32 flags or both int64 offsets"):
        activation.silu_and_mul(x, token_slots, pool, out_at, in_scale, in_scaled)


def test_silu_and_mul_rejects_partial_ia3_arguments():
    with pytest.raises(ValueError, match="together"):
        activation.silu_and_mul(torch.zeros(2, 8, device=DEVICE),
                                torch.zeros(2, dtype=torch.int32, device=DEVICE))


@gpu
@skip_without_cuda
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_silu_and_mul_ia3_bf16_llama_shapes(num_tokens):
    x = torch.randn(num_tokens, 2 * 14336, device="cuda", dtype=torch.bfloat16) * 4
    token_slots = torch.arange(num_tokens, device="cuda", dtype=torch.int32) % 4
    ia3 = _ia3(4, 14336, (1,), (1, 2), "cuda")
    out = activation.silu_and_mul(x, token_slots, *ia3)
    assert_close_bf16(out, ref.silu_and_mul(x, token_slots, *ia3), atol=2e-2, rtol=1e-2)


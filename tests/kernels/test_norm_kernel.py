import pytest
import torch

from loraplex.kernels import norm
from loraplex.kernels import reference as ref
from tests.kernels.kernel_testing import (
    DEVICE,
    INTERPRETER_DTYPES,
    assert_close_bf16,
    gpu,
    guarded_rows,
    poisoned_allocations,
    skip_without_cuda,
)

EPS = 1e-5


def _inputs(num_tokens, hidden, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g) * 3
    residual = torch.randn(num_tokens, hidden, generator=g)
    weight = 1 + 0.1 * torch.randn(hidden, generator=g)
    return x.to(device, dtype), residual.to(device, dtype), weight.to(device, dtype)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
def test_rms_norm_matches_reference_on_guarded_rows(dtype):
    x, _, weight = _inputs(5, 96, dtype, DEVICE)
    xg = guarded_rows(x)
    with poisoned_allocations(norm):
        out = norm.rms_norm(xg, weight, EPS)
    expected = ref.rms_norm(x, weight, EPS)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
def test_fused_add_rms_norm_matches_reference_and_leaves_inputs(dtype):
    x, residual, weight = _inputs(4, 80, dtype, DEVICE, seed=1)
    xg, rg = guarded_rows(x), guarded_rows(residual)
    x_before, r_before = xg.clone(), rg.clone()
    with poisoned_allocations(norm):
        out, new_residual = norm.fused_add_rms_norm(xg, rg, weight, EPS)
    expected_out, expected_residual = ref.fused_add_rms_norm(x, residual, weight, EPS)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    torch.testing.assert_close(out, expected_out, atol=tol, rtol=tol)
    assert torch.equal(xg, x_before) and torch.equal(rg, r_before)


def test_float32_residual_stream_on_fp16_rows():
    """A 16-bit model's residual kept in float32: the sum stays float32, the normalised rows
    come back in fp16 for the next GEMM."""
    x, residual, weight = _inputs(4, 80, torch.float16, DEVICE, seed=3)
    residual = residual.float() / 3 + 1e-3  # values fp16 cannot hold
    with poisoned_allocations(norm):
        out, new_residual = norm.fused_add_rms_norm(guarded_rows(x), guarded_rows(residual), weight, EPS)
    expected_out, expected_residual = ref.fused_add_rms_norm(x, residual, weight, EPS)
    assert new_residual.dtype == torch.float32 and out.dtype == torch.float16
    assert not torch.equal(expected_residual, expected_residual.half().float())
    torch.testing.assert_close(new_residual, expected_residual, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out, expected_out, atol=2e-3, rtol=2e-3)


def test_fp32_weight_on_fp16_rows_promotes_like_the_reference():
    x, _, weight = _inputs(3, 64, torch.float16, DEVICE, seed=2)
    out = norm.rms_norm(x, weight.float(), EPS)
    expected = ref.rms_norm(x, weight.float(), EPS)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_empty_batch():
    x, _, weight = _inputs(0, 64, torch.float32, DEVICE)
    assert norm.rms_norm(x, weight, EPS).shape == (0, 64)


def test_wrapper_rejects_bad_inputs():
    x, residual, weight = _inputs(2, 64, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="weight"):
        norm.rms_norm(x, weight[:32], EPS)
    with pytest.raises(ValueError, match="dims"):
        norm.rms_norm(x[0], weight, EPS)
    with pytest.raises(ValueError, match="unit stride"):
        norm.rms_norm(x.t(), weight[:2], EPS)
    with pytest.raises(ValueError, match="residual"):
        norm.fused_add_rms_norm(x, residual.half(), weight, EPS)
    with pytest.raises(ValueError, match="one of"):
        norm.rms_norm(x.int(), weight, EPS)


@gpu
@skip_without_cuda
@pytest.mark.parametrize("num_tokens", [1, 64, 3000])
def test_norms_bf16_llama_shapes(num_tokens):
    x, residual, weight = _inputs(num_tokens, 4096, torch.bfloat16, "cuda", seed=3)
    out, new_residual = norm.fused_add_rms_norm(x, residual, weight, EPS)
    expected_residual = x.float() + residual.float()
    expected = ref.rms_norm(expected_residual, weight.float(), EPS)
    assert_close_bf16(new_residual, expected_residual, atol=1e-2, rtol=1e-2)
    assert_close_bf16(out, expected, atol=2e-2, rtol=1e-2)
    plain = norm.rms_norm(x, weight, EPS)
    assert_close_bf16(plain, ref.rms_norm(x.float(), weight.float(), EPS), atol=2e-2, rtol=1e-2)


@gpu
@skip_without_cuda
@pytest.mark.parametrize("num_tokens", [1, 64, 3000])
def test_fused_norm_bf16_rows_float32_residual(num_tokens):
    x, residual, weight = _inputs(num_tokens, 4096, torch.bfloat16, "cuda", seed=4)
    residual = residual.float() * 7
    out, new_residual = norm.fused_add_rms_norm(x, residual, weight, EPS)
    expected_out, expected_residual = ref.fused_add_rms_norm(x, residual, weight, EPS)
    assert new_residual.dtype == torch.float32 and out.dtype == torch.bfloat16
    torch.testing.assert_close(new_residual, expected_residual, atol=1e-5, rtol=1e-6)
    assert_close_bf16(out, expected_out, atol=2e-2, rtol=1e-2)

import pytest
import torch

from loraplex.kernels import activation
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

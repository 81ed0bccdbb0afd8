"""SiLU-and-mul for the gated MLP: grid (num_tokens, column blocks). silu(gate) is computed in
float32 and rounded to x's dtype before the multiply, as torch's F.silu(gate) * up does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels._common import FLOAT_DTYPES, cdiv, check_launchable, check_tensor

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, intermediate, stride_x, stride_out,
                         BLOCK_SIZE: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < intermediate
    gate = tl.load(x_ptr + tok * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + tok * stride_x + intermediate + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + tok * stride_out + cols, silu * up.to(tl.float32), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, 2 * intermediate] (gate | up) -> silu(gate) * up [num_tokens, intermediate]
    in x's dtype. Rows may be strided; each row must be dense."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, width = x.shape
    if width % 2:
        raise ValueError(f"x's last dim must be even (gate | up), got {width}")
    check_launchable(_silu_and_mul_kernel, (x,))
    intermediate = width // 2
    out = torch.empty((num_tokens, intermediate), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or intermediate == 0:
        return out
    grid = (num_tokens, cdiv(intermediate, BLOCK))
    _silu_and_mul_kernel[grid](x, out, intermediate, x.stride(0), out.stride(0),
                               BLOCK_SIZE=BLOCK, num_warps=4)
    return out

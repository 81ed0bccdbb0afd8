"""RMSNorm, plain and fused with the residual add: one program per row, the whole row in
registers. Rounds as the reference does: the residual sum to the residual's dtype (x's, or
float32), the normalised row to x's dtype, then the weight multiply in the promoted dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels._common import FLOAT_DTYPES, check_launchable, check_tensor, next_pow2

MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    hidden, stride_x, stride_residual, stride_out, stride_residual_out, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # x + residual in the residual's dtype, as torch adds two 16-bit tensors (or a 16-bit
        # one to a float32 one).
        x = (x + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
        x = x.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / hidden
    normed = (x * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, normed * w, mask=mask)


def _num_warps(block: int) -> int:
    return min(max(block // 512, 1), 16)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, shape=(x.shape[1],))
    if x.shape[1] > MAX_HIDDEN:
        raise ValueError(f"hidden size {x.shape[1]} is over the supported {MAX_HIDDEN}")


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    num_tokens, hidden = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = None
    if residual is not None:
        residual_out = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
    if num_tokens == 0:
        return out, residual_out
    block = next_pow2(hidden)
    res_in = residual if residual is not None else x
    res_out = residual_out if residual_out is not None else out
    _rms_norm_kernel[(num_tokens,)](
        x, res_in, weight, out, res_out,
        hidden, x.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block),
    )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [num_tokens, hidden], weight [hidden] -> [num_tokens, hidden] in the promoted dtype of
    x and weight. Rows may be strided; each row must be dense."""
    _check(x, weight)
    check_launchable(_rms_norm_kernel, (x, weight))
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [num_tokens, hidden], weight [hidden] -> (rms_norm(x + residual), x + residual).
    The residual has x's dtype, or float32 (kept unrounded); the sum comes back in its dtype,
    the normalised rows in x's (promoted with the weight's). The inputs are not modified; both
    outputs are new tensors."""
    _check(x, weight)
    check_tensor("residual", residual, ndim=2, dtypes=(x.dtype, torch.float32), shape=tuple(x.shape))
    check_launchable(_rms_norm_kernel, (x, residual, weight))
    out, residual_out = _launch(x, residual, weight, eps)
    return out, residual_out


def rms_norm_unchecked(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm without its argument checks, for inputs that meet its contract by construction
    (the engine's forward: `triton_ops(check_inputs=False)`)."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_unchecked(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm without its argument checks (as rms_norm_unchecked)."""
    return _launch(x, residual, weight, eps)

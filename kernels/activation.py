"""SiLU-and-mul for the gated MLP: grid (num_tokens, column blocks). silu(gate) is computed in
float32 and rounded to x's dtype before the multiply, as torch's F.silu(gate) * up does.

With adapters (IA3), the kernel also applies each token's vectors, gathered by its adapter slot:
gate and up are scaled first (the output vectors of gate_proj and up_proj) and the product after
(the input vector of down_proj), each rounded to x's dtype as the separate ops would round it.
A token whose slot sets no flag reads no vector, so a batch without IA3 reads one flag a token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    cdiv,
    check_ia3_vectors,
    check_launchable,
    check_tensor,
)

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, slots_ptr, scale_ptr, scaled_ptr, in_scale_ptr,
                         in_scaled_ptr, intermediate, stride_x, stride_out, stride_scale,
                         stride_in_scale, HAS_SCALE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         OFFSETS: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < intermediate
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + tok * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + tok * stride_x + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        slot = tl.load(slots_ptr + tok).to(tl.int64)
        if OFFSETS:  # the slot's vectors are at offsets of the pool (-1: none)
            at = tl.load(scaled_ptr + slot)
            on = cols < tl.where(at >= 0, intermediate, 0)
            row = scale_ptr + tl.maximum(at, 0)
        else:
            on = cols < tl.where(tl.load(scaled_ptr + slot) != 0, intermediate, 0)  # no bytes when off
            row = scale_ptr + slot * stride_scale
        gate = (gate * tl.load(row + cols, mask=on, other=1.0)).to(dtype).to(tl.float32)
        up = (up * tl.load(row + intermediate + cols, mask=on, other=1.0)).to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    out = silu * up
    if HAS_SCALE:
        if OFFSETS:
            in_at = tl.load(in_scaled_ptr + slot)
            on_in = cols < tl.where(in_at >= 0, intermediate, 0)
            in_row = in_scale_ptr + tl.maximum(in_at, 0)
        else:
            on_in = cols < tl.where(tl.load(in_scaled_ptr + slot) != 0, intermediate, 0)
            in_row = in_scale_ptr + slot * stride_in_scale
        out = out.to(dtype).to(tl.float32) * tl.load(in_row + cols, mask=on_in, other=1.0)
    tl.store(out_ptr + tok * stride_out + cols, out, mask=mask)


def silu_and_mul(
    x: torch.Tensor, token_slots: torch.Tensor | None = None, scale: torch.Tensor | None = None,
    scaled: torch.Tensor | None = None, in_scale: torch.Tensor | None = None,
    in_scaled: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [num_tokens, 2 * intermediate] (gate | up) -> silu(gate) * up [num_tokens, intermediate]
    in x's dtype. Rows may be strided; each row must be dense.
    IA3, all five given or none: token_slots [num_tokens] int; scale [num_slots, 2 * intermediate]
    float32 multiplies gate | up of the tokens whose slot sets scaled [num_slots] int32;
    in_scale [num_slots, intermediate] float32 multiplies the result of the tokens whose slot sets
    in_scaled [num_slots] int32. Or (paged adapters) scale and in_scale the pool as 1-D float32
    and scaled, in_scaled [num_slots] int64: where each slot's vector starts in it (-1: none).
    See reference.py."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, width = x.shape
    if width % 2:
        raise ValueError(f"x's last dim must be even (gate | up), got {width}")
    intermediate = width // 2
    extra = (token_slots, scale, scaled, in_scale, in_scaled)
    has_scale = token_slots is not None
    if any((t is None) == has_scale for t in extra):
        raise ValueError("give token_slots, scale, scaled, in_scale and in_scaled together, or none")
    if has_scale:
        check_tensor("token_slots", token_slots, ndim=1, dtypes=INDEX_DTYPES, shape=(num_tokens,),
                     contiguous=True)
        offsets = scaled.dtype == torch.int64
        if (in_scaled.dtype == torch.int64) != offsets:
            raise ValueError("scaled and in_scaled must be both int32 flags or both int64 offsets")
        check_ia3_vectors("scale", scale, "scaled", scaled, width)
        check_ia3_vectors("in_scale", in_scale, "in_scaled", in_scaled, intermediate)
        if not offsets and in_scale.shape[0] != scale.shape[0]:
            raise ValueError(f"scale and in_scale rows differ ({scale.shape[0]}, {in_scale.shape[0]})")
    check_launchable(_silu_and_mul_kernel, (x, *(t for t in extra if t is not None)))
    return silu_and_mul_unchecked(x, token_slots, scale, scaled, in_scale, in_scaled)


def silu_and_mul_unchecked(
    x: torch.Tensor, token_slots: torch.Tensor | None = None, scale: torch.Tensor | None = None,
    scaled: torch.Tensor | None = None, in_scale: torch.Tensor | None = None,
    in_scaled: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu_and_mul without its argument checks, for inputs that meet its contract by
    construction (the engine's forward: `triton_ops(check_inputs=False)`)."""
    num_tokens, intermediate = x.shape[0], x.shape[1] // 2
    has_scale = token_slots is not None
    out = torch.empty((num_tokens, intermediate), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or intermediate == 0:
        return out
    grid = (num_tokens, cdiv(intermediate, BLOCK))
    _silu_and_mul_kernel[grid](
        x, out, token_slots if has_scale else x, scale if has_scale else x,
        scaled if has_scale else x, in_scale if has_scale else x, in_scaled if has_scale else x,
        intermediate, x.stride(0), out.stride(0), scale.stride(0) if has_scale and scale.dim() == 2 else 0,
        in_scale.stride(0) if has_scale and in_scale.dim() == 2 else 0, HAS_SCALE=has_scale, BLOCK_SIZE=BLOCK,
        OFFSETS=has_scale and scaled.dtype == torch.int64, num_warps=4)
    return out

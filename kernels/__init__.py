"""Kernels of the forward pass, imported as `loraplex.kernels`.

`select_ops(device)` returns the op set for a device: the Triton kernels on CUDA, the torch
reference (`reference.py`) on CPU. Both sets have the same signatures, documented in
reference.py. This package never imports the rest of loraplex.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ops:
    """One implementation of every op the model calls."""

    name: str
    linear: Callable
    rms_norm: Callable
    fused_add_rms_norm: Callable
    rotary_store_kv: Callable
    paged_attention: Callable
    paged_decode_attention: Callable
    relay_decode_attention: Callable
    silu_and_mul: Callable
    lora_shrink: Callable
    lora_expand: Callable
    scale_rows: Callable
    flora_stack: Callable
    flora_combine: Callable
    lora_shrink_paged: Callable
    lora_expand_paged: Callable
    lone_split: Callable
    """token_slots -> what lora_shrink_paged and lora_expand_paged take as `split` (None: none),
    made once a forward pass."""
    scale_rows_paged: Callable
    flora_stack_paged: Callable
    flora_combine_paged: Callable
    sample: Callable
    argmax: Callable
    mask_logits: Callable
    score_tokens: Callable


def reference_ops() -> Ops:
    from loraplex.kernels import reference as r

    return Ops(
        name="reference",
        linear=r.linear,
        rms_norm=r.rms_norm,
        fused_add_rms_norm=r.fused_add_rms_norm,
        rotary_store_kv=r.rotary_store_kv,
        paged_attention=r.paged_attention,
        paged_decode_attention=r.paged_decode_attention,
        relay_decode_attention=r.relay_decode_attention,
        silu_and_mul=r.silu_and_mul,
        lora_shrink=r.lora_shrink,
        lora_expand=r.lora_expand,
        scale_rows=r.scale_rows,
        flora_stack=r.flora_stack,
        flora_combine=r.flora_combine,
        lora_shrink_paged=r.lora_shrink_paged,
        lora_expand_paged=r.lora_expand_paged,
        lone_split=r.no_split,
        scale_rows_paged=r.scale_rows_paged,
        flora_stack_paged=r.flora_stack_paged,
        flora_combine_paged=r.flora_combine_paged,
        sample=r.sample,
        argmax=r.argmax,
        mask_logits=r.mask_logits,
        score_tokens=r.score_tokens,
    )


def select_ops(device: torch.device | str, kind: str = "auto", check_inputs: bool = True) -> Ops:
    """The op set for `device`: by default Triton on CUDA, the torch reference elsewhere;
    `kind` "triton" or "reference" forces one. check_inputs=False: the Triton ops of every
    layer skip their argument checks (for the engine's forward; see triton_ops.py)."""
    if kind == "triton" or (kind == "auto" and torch.device(device).type == "cuda"):
        from loraplex.kernels.triton_ops import triton_ops

        return triton_ops(check_inputs)
    return reference_ops()


def engine_ops(device: torch.device | str, kind: str = "auto") -> Ops:
    """The op set that the engine's forward runs on `device` (select_ops without the layer ops'
    argument checks on Triton): what benchmarks that build their own model should pass it."""
    return select_ops(device, kind, check_inputs=False)

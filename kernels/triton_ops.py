"""The Triton op set: every field of `Ops` is a Triton wrapper with the reference's signature.
Importing this module compiles nothing; kernels are compiled on first call.

`triton_ops(check_inputs=False)` is the set for the engine's forward: the ops that an eager step
calls in every layer (the norms, rotary, prefill attention, the activation, the LoRA shrink and
expand) skip their argument checks: 60% of their host time (scripts/wrapper-overhead.py).
The engine's step inputs and page tables have the layouts those checks ask for by construction,
and the model's activations come out of the kernels before; tests, benchmarks and direct callers
keep the checks."""

from __future__ import annotations

from loraplex.kernels import Ops
from loraplex.kernels.activation import silu_and_mul, silu_and_mul_unchecked
from loraplex.kernels.adapter_families import flora_combine, flora_stack, scale_rows
from loraplex.kernels.adapter_families_paged import flora_combine_paged, flora_stack_paged, scale_rows_paged
from loraplex.kernels.argmax import argmax
from loraplex.kernels.decode_attention import paged_decode_attention
from loraplex.kernels.lora import lora_expand, lora_shrink
from loraplex.kernels.lora_paged import (
    lone_split,
    lora_expand_paged,
    lora_expand_paged_unchecked,
    lora_shrink_paged,
    lora_shrink_paged_unchecked,
)
from loraplex.kernels.norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_unchecked,
    rms_norm,
    rms_norm_unchecked,
)
from loraplex.kernels.prefill_attention import paged_attention, paged_attention_unchecked
from loraplex.kernels.relay_attention import relay_decode_attention
from loraplex.kernels.rotary import rotary_store_kv, rotary_store_kv_unchecked
from loraplex.kernels.sampling import sample
from loraplex.kernels.scoring import score_tokens
from loraplex.kernels.skinny_gemm import linear
from loraplex.kernels.token_mask import mask_logits


def triton_ops(check_inputs: bool = True) -> Ops:
    return Ops(
        name="triton",
        linear=linear,
        rms_norm=rms_norm if check_inputs else rms_norm_unchecked,
        fused_add_rms_norm=fused_add_rms_norm if check_inputs else fused_add_rms_norm_unchecked,
        rotary_store_kv=rotary_store_kv if check_inputs else rotary_store_kv_unchecked,
        paged_attention=paged_attention if check_inputs else paged_attention_unchecked,
        paged_decode_attention=paged_decode_attention,
        relay_decode_attention=relay_decode_attention,
        silu_and_mul=silu_and_mul if check_inputs else silu_and_mul_unchecked,
        lora_shrink=lora_shrink,
        lora_expand=lora_expand,
        scale_rows=scale_rows,
        flora_stack=flora_stack,
        flora_combine=flora_combine,
        lora_shrink_paged=lora_shrink_paged if check_inputs else lora_shrink_paged_unchecked,
        lora_expand_paged=lora_expand_paged if check_inputs else lora_expand_paged_unchecked,
        lone_split=lone_split,
        scale_rows_paged=scale_rows_paged,
        flora_stack_paged=flora_stack_paged,
        flora_combine_paged=flora_combine_paged,
        sample=sample,
        argmax=argmax,
        mask_logits=mask_logits,
        score_tokens=score_tokens,
    )

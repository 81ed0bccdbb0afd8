"""Host time of the Triton wrappers that one eager layer of a mixed step calls (a prompt chunk
beside decodes), with every launch a no-op: what the wrappers' checks, launch configs and
allocations cost before Triton's own launch. Llama-3-8B shapes (hidden 4096, intermediate 14336,
32 heads, 8 KV heads, head_dim 128), bf16, 288 tokens (32 decodes and a 256-token prompt chunk),
64 adapter slots of rank 16 with IA3 offsets (as the engine passes them), on the CPU under the
Triton interpreter, whose launches this script replaces by a function that does nothing.

Run: TRITON_INTERPRET=1 PYTHONPATH=. python scripts/wrapper-overhead.py [--calls N] [--json PATH]
Prints microseconds a call (the best of `--repeats` runs of `--calls` calls) per wrapper, the
sum for one layer and the estimate for a 32-layer step, for the op set with its argument checks
(`triton_ops()`, what tests and direct callers get) and without (`triton_ops(check_inputs=False)`,
the engine's forward). The dense GEMMs (cuBLAS) are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from loraplex.kernels.triton_ops import triton_ops  # noqa: E402

HIDDEN, INTERMEDIATE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
NUM_DECODES, PROMPT = 32, 256
NUM_TOKENS = NUM_DECODES + PROMPT
NUM_SLOTS, RANK, PAGE_RANK = 64, 16, 8
NUM_LAYERS, BLOCK_SIZE, NUM_BLOCKS = 32, 16, 64
DTYPE = torch.bfloat16
Q, KV = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
GROUPS = {  # group: (in_features, slice_offsets)
    "qkv": (HIDDEN, (0, Q, Q + KV, Q + 2 * KV)),
    "o": (Q, (0, HIDDEN)),
    "gate_up": (HIDDEN, (0, INTERMEDIATE, 2 * INTERMEDIATE)),
    "down": (INTERMEDIATE, (0, HIDDEN)),
}


def _no_launch(*args, **kwargs) -> None:
    return None


def make_group(offsets: tuple[int, ...], pool: torch.Tensor, has_shift: bool) -> dict:
    """One layer's page tables of a group: views of [2 layers, ...] tensors, as the engine's."""
    slots, slices = NUM_SLOTS + 1, len(offsets) - 1
    pages = torch.zeros(2, slots, slices, RANK // PAGE_RANK, dtype=torch.int64)
    at = torch.full((2, slots), -1, dtype=torch.int64)
    return dict(pool=pool, vectors=pool.view(torch.float32), a_pages=pages[1], b_pages=pages.clone()[1],
                ranks=torch.full((2, slots, slices), RANK, dtype=torch.int32)[1], scale_at=at[1],
                shift_at=at.clone()[1] if has_shift else None, fused_scale_at=at.clone()[1],
                in_scale_at=at.clone()[1], slice_offsets=offsets, max_rank=RANK)


def layer_calls(ops) -> dict:
    """name -> a callable making one wrapper call with one eager layer's inputs."""
    pool = torch.zeros(1 << 20, dtype=DTYPE)
    groups = {name: make_group(offsets, pool, name == "qkv") for name, (_, offsets) in GROUPS.items()}
    token_slots = torch.randint(0, NUM_SLOTS + 1, (NUM_TOKENS,), dtype=torch.int32)
    x = torch.randn(NUM_TOKENS, HIDDEN, dtype=DTYPE)
    residual = torch.randn(NUM_TOKENS, HIDDEN, dtype=torch.float32)
    norm = torch.ones(HIDDEN, dtype=DTYPE)
    qkv = torch.randn(NUM_TOKENS, Q + 2 * KV, dtype=DTYPE)
    q, k, v = qkv.split((Q, KV, KV), dim=-1)
    q = q.view(NUM_TOKENS, NUM_HEADS, HEAD_DIM)
    k, v = k.view(NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM), v.view(NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM)
    kv_cache = torch.zeros(NUM_BLOCKS, 2, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE)
    kv_layer = kv_cache[:, 1]
    positions = torch.arange(NUM_TOKENS, dtype=torch.int64)
    slot_mapping = torch.arange(NUM_TOKENS, dtype=torch.int64)
    cos_sin = torch.zeros(8192, HEAD_DIM, dtype=torch.float32)
    num_seqs = NUM_DECODES + 1
    block_tables = torch.zeros(num_seqs, 32, dtype=torch.int32)
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
    query_start_loc[-1] = NUM_TOKENS
    seq_lens = torch.full((num_seqs,), 100, dtype=torch.int32)
    attn_out = torch.randn(NUM_TOKENS, Q, dtype=DTYPE)
    gate_up = torch.randn(NUM_TOKENS, 2 * INTERMEDIATE, dtype=DTYPE)
    hidden = torch.randn(NUM_TOKENS, INTERMEDIATE, dtype=DTYPE)
    inputs = {"qkv": x, "o": attn_out, "gate_up": x, "down": hidden}
    outputs = {"qkv": qkv, "o": x, "gate_up": gate_up, "down": x}
    shrunk = {name: torch.zeros(len(o) - 1, NUM_TOKENS, RANK) for name, (_, o) in GROUPS.items()}
    qkv_w, gu_w, down_w = groups["qkv"], groups["gate_up"], groups["down"]
    calls = {
        "fused_add_rms_norm": lambda: ops.fused_add_rms_norm(x, residual, norm, 1e-5),
        "rotary_store_kv": lambda: ops.rotary_store_kv(
            positions, q, k, v, cos_sin, kv_layer, slot_mapping, token_slots, qkv_w["vectors"],
            qkv_w["fused_scale_at"]),
        "paged_attention": lambda: ops.paged_attention(
            q, kv_layer, block_tables, query_start_loc, seq_lens, HEAD_DIM ** -0.5, max_query_len=PROMPT),
        "silu_and_mul": lambda: ops.silu_and_mul(
            gate_up, token_slots, gu_w["vectors"], gu_w["fused_scale_at"], gu_w["vectors"],
            down_w["in_scale_at"]),
    }
    for name, w in groups.items():
        calls[f"lora_shrink_paged[{name}]"] = lambda w=w, name=name: ops.lora_shrink_paged(
            inputs[name], w["pool"], w["a_pages"], token_slots, w["ranks"], w["max_rank"])
        calls[f"lora_expand_paged[{name}]"] = lambda w=w, name=name: ops.lora_expand_paged(
            outputs[name], shrunk[name], w["pool"], w["b_pages"], token_slots, w["ranks"],
            w["slice_offsets"], w["vectors"], w["scale_at"], w["shift_at"])
    return calls


CALLS_PER_LAYER = {  # how many times a layer calls each wrapper
    "fused_add_rms_norm": 2, "rotary_store_kv": 1, "paged_attention": 1, "silu_and_mul": 1,
    **{f"lora_{kind}_paged[{name}]": 1 for name in GROUPS for kind in ("shrink", "expand")},
}


def time_call(call, num_calls: int, repeats: int) -> float:
    """Microseconds a call: the best of `repeats` runs."""
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(num_calls):
            call()
        best = min(best, (time.perf_counter_ns() - start) / num_calls / 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    InterpretedFunction.__getitem__ = lambda self, grid: _no_launch
    figures = {}
    for label, check_inputs in (("checked", True), ("unchecked", False)):
        calls = layer_calls(triton_ops(check_inputs))
        figures[label] = {name: time_call(call, args.calls, args.repeats) for name, call in calls.items()}
    layer = {label: sum(us * CALLS_PER_LAYER[name] for name, us in f.items()) for label, f in figures.items()}
    print(f"{'us a call':32s} {'checked':>9s} {'unchecked':>9s}  (triton_ops(check_inputs=False))")
    for name in figures["checked"]:
        print(f"{name:32s} {figures['checked'][name]:9.2f} {figures['unchecked'][name]:9.2f}  "
              f"x {CALLS_PER_LAYER[name]} a layer")
    print(f"{'one layer (us)':32s} {layer['checked']:9.1f} {layer['unchecked']:9.1f}")
    print(f"{'32 layers (ms)':32s} {layer['checked'] * NUM_LAYERS / 1e3:9.2f} "
          f"{layer['unchecked'] * NUM_LAYERS / 1e3:9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"per_call_us": figures, "layer_us": layer,
                       "step_ms": {k: v * NUM_LAYERS / 1e3 for k, v in layer.items()}}, f, indent=1)

if __name__ == "__main__":
    main()

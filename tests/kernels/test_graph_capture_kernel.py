"""Every Triton op runs inside a captured CUDA graph (no host sync, no allocation it cannot
make from the graph's pool) and its replay gives what the eager call gave."""

import pytest
import torch

from loraplex.kernels.triton_ops import triton_ops
from tests.kernels.kernel_testing import gpu, make_paged_kv, skip_without_cuda


def _cases(device="cuda"):
    ops = triton_ops()
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device, torch.bfloat16)
    x, res, w = rnd(8, 256), rnd(8, 256), rnd(256)
    kv_layer, tables = make_paged_kv([5, 40, 0, 17], 2, 64, 16, torch.bfloat16, device)
    kv_layer.nan_to_num_(0.0)
    lens = torch.tensor([5, 40, 0, 17], dtype=torch.int32, device=device)
    q = rnd(4, 8, 64)
    qsl = torch.tensor([0, 2, 5, 5, 6], dtype=torch.int32, device=device)
    q_prefill = rnd(6, 8, 64)
    qkv = rnd(4, 8 * 64 + 2 * 2 * 64)
    positions = torch.arange(4, device=device)
    cos_sin = torch.randn(64, 64, generator=g).to(device)
    slots_kv = torch.tensor([3, -1, 20, 7], device=device)
    a = rnd(3, 3, 16, 256)
    b = rnd(3, 192, 16)
    ranks = torch.tensor([[0, 0, 0], [16, 8, 0], [4, 16, 16]], dtype=torch.int32, device=device)
    slots = torch.tensor([1, 0, 2, 2, 1, 0, 2, 1], dtype=torch.int32, device=device)
    y0 = rnd(8, 192)
    logits = torch.randn(4, 1000, generator=g).to(device)
    sample_args = (logits, torch.tensor([0.0, 1.0, 0.7, 1.0], device=device),
                   torch.tensor([0, 0, 20, 5], dtype=torch.int32, device=device),
                   torch.tensor([1.0, 0.9, 0.8, 1.0], device=device),
                   torch.arange(4, device=device), torch.arange(4, device=device))
    mask_rows = torch.tensor([0, -1, 2, -1], dtype=torch.int64, device=device)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, 32), generator=g, dtype=torch.int32).to(device)

    def rotary():
        cache = kv_layer.clone()
        q_, k_, v_ = qkv.split((512, 128, 128), dim=-1)
        out = ops.rotary_store_kv(positions, q_.view(4, 8, 64), k_.view(4, 2, 64),
                                  v_.view(4, 2, 64), cos_sin, cache, slots_kv)
        return out, cache

    def lora():
        y = y0.clone()
        shrunk = ops.lora_shrink(x, a, slots, ranks)
        return ops.lora_expand(y, shrunk, b, slots, ranks, (0, 128, 160, 192)), shrunk

    return {
        "rms_norm": lambda: ops.rms_norm(x, w, 1e-5),
        "fused_add_rms_norm": lambda: ops.fused_add_rms_norm(x, res, w, 1e-5),
        "rotary_store_kv": rotary,
        "paged_decode_attention": lambda: ops.paged_decode_attention(q, kv_layer, tables, lens,
                                                                     0.125),
        "paged_decode_attention (splits)": lambda: ops.paged_decode_attention(
            q, kv_layer, tables, lens, 0.125, num_splits=4),
        "paged_attention": lambda: ops.paged_attention(q_prefill, kv_layer, tables, qsl, lens,
                                                       0.125, return_lse=True, max_query_len=3),
        "silu_and_mul": lambda: ops.silu_and_mul(x),
        "lora_shrink+expand": lora,
        "sample": lambda: ops.sample(*sample_args),
        # structured outputs' masked draw: rows 0 and 2 masked, the others flagged -1
        "mask_logits+sample": lambda: ops.sample(ops.mask_logits(logits, mask_rows, bitmask),
                                                 *sample_args[1:]),
    }


@gpu
@skip_without_cuda
@pytest.mark.parametrize("name", [
    "rms_norm", "fused_add_rms_norm", "rotary_store_kv", "paged_decode_attention",
    "paged_decode_attention (splits)", "paged_attention", "silu_and_mul", "lora_shrink+expand",
    "sample", "mask_logits+sample"])
def test_op_replays_in_a_cuda_graph(name):
    call = _cases()[name]
    eager = call()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm-up off the default stream, as capture wants
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    torch.cuda.synchronize()
    eager = eager if isinstance(eager, tuple) else (eager,)
    captured = captured if isinstance(captured, tuple) else (captured,)
    for e, c in zip(eager, captured):
        torch.testing.assert_close(c, e, equal_nan=True, atol=0, rtol=0)

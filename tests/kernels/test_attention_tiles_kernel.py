"""The shared tile loop (kernels/attention_tiles.py) on what decode and prefill do not exercise:
state carried over two token ranges (a start off any tile or page boundary), and one pass over
a shared prefix for the rows of several requests, merged with each request's own part through
the log-sum-exp, as RelayAttention will use it."""

import pytest
import torch
import triton
import triton.language as tl

from loraplex.kernels import reference as ref
from loraplex.kernels._common import check_launchable, next_pow2, upcast_loads
from loraplex.kernels.attention_tiles import LOG2E, attend_paged_tiles, empty_state
from tests.kernels.kernel_testing import DEVICE, make_paged_kv, rel_error

BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS = 8, 16, 2


@triton.jit
def _two_ranges_kernel(
    q_ptr, kv_ptr, table_a_ptr, table_b_ptr, out_ptr, lse_ptr,
    end_a, start_b, end_b, num_rows, num_heads, group, head_dim,
    stride_kv_block, stride_kv_kv, stride_kv_tok, stride_kv_head, scale_log2,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):
    """Grid (num_kv_heads,). Rows: every query [members, num_heads, head_dim] of the q heads of
    this KV head; each attends to tokens [0, end_a) of table_a, then [start_b, end_b) of
    table_b. Writes out [members, num_heads, head_dim] and lse [members, num_heads] (log2)."""
    kv_head = tl.program_id(0)
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    row = (r // group) * num_heads + kv_head * group + r % group  # [BLOCK_M] (member, head)
    mask = (r < num_rows)[:, None] & (d < head_dim)[None, :]
    q = tl.load(q_ptr + row[:, None] * head_dim + d[None, :], mask=mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    kv_base = kv_ptr + kv_head * stride_kv_head
    m_i, l_i, acc = empty_state(BLOCK_M, BLOCK_D)
    m_i, l_i, acc = attend_paged_tiles(
        q, m_i, l_i, acc, kv_base, table_a_ptr, 0, end_a,
        scale_log2, stride_kv_block, stride_kv_kv, stride_kv_tok, head_dim,
        PAGE_SIZE, BLOCK_N, BLOCK_D, UPCAST,
    )
    m_i, l_i, acc = attend_paged_tiles(
        q, m_i, l_i, acc, kv_base, table_b_ptr, start_b, end_b,
        scale_log2, stride_kv_block, stride_kv_kv, stride_kv_tok, head_dim,
        PAGE_SIZE, BLOCK_N, BLOCK_D, UPCAST,
    )
    has_keys = l_i > 0
    tl.store(out_ptr + row[:, None] * head_dim + d[None, :],
             acc / tl.where(has_keys, l_i, 1.0)[:, None], mask=mask)
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + row, lse, mask=r < num_rows)


def _two_ranges(q, kv_layer, table_a, end_a, table_b, start_b, end_b, scale, block_n=16):
    """q [members, num_heads, head_dim] -> (out like q, lse [members, num_heads] natural log)."""
    check_launchable(_two_ranges_kernel, (q, kv_layer, table_a, table_b))
    members, num_heads, head_dim = q.shape
    group = num_heads // kv_layer.shape[3]
    out = torch.full_like(q, float("nan"))
    lse = torch.full((members, num_heads), float("nan"), device=q.device)
    _two_ranges_kernel[(kv_layer.shape[3],)](
        q, kv_layer, table_a, table_b, out, lse, end_a, start_b, end_b, members * group,
        num_heads, group, head_dim, kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2),
        kv_layer.stride(3), scale * LOG2E,
        PAGE_SIZE=kv_layer.shape[2], BLOCK_M=max(16, next_pow2(members * group)),
        BLOCK_N=block_n, BLOCK_D=next_pow2(head_dim), UPCAST=upcast_loads(q.dtype),
    )
    return out, lse / LOG2E


def _attend(q, k, v, scale):
    """q [num_heads, d], k and v [n, kv_heads, d] -> (out [num_heads, d], lse [num_heads])."""
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,nhd->hn", q.double(), k.double()) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hn,nhd->hd", torch.exp(scores - lse[:, None]).nan_to_num(0.0), v.double())
    return out, lse


def _query(members, num_heads, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(members, num_heads, HEAD_DIM, generator=g).to(DEVICE)


@pytest.mark.parametrize("split", [0, 1, 5, 15, 16, 17, 33, 47, 48])
def test_state_carries_over_two_ranges(split):
    seq_len = 48  # three 16-token tiles; the second range starts anywhere in them
    kv_layer, tables = make_paged_kv([seq_len], NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                                     torch.float32, DEVICE, seed=split)
    q = _query(1, 8, split)
    out, lse = _two_ranges(q, kv_layer, tables[0], split, tables[0], split, seq_len, 0.3)
    qsl = torch.arange(2, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([seq_len], dtype=torch.int32, device=DEVICE)
    expected, expected_lse = ref.paged_attention(q, kv_layer, tables, qsl, lens, 0.3,
                                                 return_lse=True)
    assert rel_error(out, expected) < 1e-5
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("prefix_len", [0, 1, 15, 16, 17, 40])
def test_shared_prefix_pass_merged_with_own_parts(group, prefix_len):
    """Members' rows share one pass over the prefix; each member's own blocks give a second
    partial; o = sigmoid(lse_p - lse_o) * o_p + (1 - sigmoid(...)) * o_o gives attention over
    the prefix followed by its own tokens."""
    own_lens = [1, 9, 30]
    kv_layer, tables = make_paged_kv([prefix_len, *own_lens], NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                                     torch.float32, DEVICE, seed=group * 100 + prefix_len)
    q = _query(len(own_lens), NUM_KV_HEADS * group, prefix_len)
    scale = HEAD_DIM ** -0.5
    unused = tables[0]  # the table of an empty second range
    prefix_out, prefix_lse = _two_ranges(q, kv_layer, tables[0], prefix_len, unused, 0, 0, scale)
    prefix_k, prefix_v = ref.gather_kv(kv_layer, tables[:1], prefix_len)
    for i, own_len in enumerate(own_lens):
        own_out, own_lse = _two_ranges(q[i:i + 1], kv_layer, tables[i + 1], own_len, unused, 0, 0,
                                       scale)
        w = torch.sigmoid(prefix_lse[i] - own_lse[0])[:, None]  # [num_heads, 1]
        merged = w * prefix_out[i] + (1 - w) * own_out[0]
        own_k, own_v = ref.gather_kv(kv_layer, tables[i + 1:i + 2], own_len)
        expected, _ = _attend(q[i], torch.cat([prefix_k[0], own_k[0]]),
                              torch.cat([prefix_v[0], own_v[0]]), scale)
        assert rel_error(merged, expected) < 1e-5
        if prefix_len:
            expected_p, expected_lse = _attend(q[i], prefix_k[0], prefix_v[0], scale)
            assert rel_error(prefix_out[i], expected_p) < 1e-5
            torch.testing.assert_close(prefix_lse[i].double(), expected_lse, atol=1e-5,
                                       rtol=1e-5)
        else:  # no key: zeros and lse -inf, so the merge takes the own part alone
            assert torch.equal(prefix_out[i], torch.zeros_like(prefix_out[i]))
            assert torch.isneginf(prefix_lse[i]).all()

import pytest
import torch

from loraplex.kernels import prefill_attention
from loraplex.kernels import reference as ref
from tests.kernels.kernel_testing import (
    DEVICE,
    INTERPRETER_DTYPES,
    cosine,
    gpu,
    make_paged_kv,
    poisoned_allocations,
    rel_error,
    skip_without_cuda,
)


def _batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
           device, *, pad_tokens=0, seed=0):
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    kv_layer, block_tables = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype,
                                           device, seed=seed)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(starts[-1] + pad_tokens, num_heads, head_dim, generator=g).to(device, dtype)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, kv_layer, block_tables, query_start_loc, lens


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
def test_prefill_matches_reference_chunked_gqa(dtype):
    # A fresh prompt, a chunk over cached context, a sequence with no new token, a single
    # token; group of 3 (not a power of two); two padding rows after the last sequence.
    query_lens, context_lens = [21, 7, 0, 1], [0, 13, 9, 30]
    q, kv_layer, block_tables, qsl, lens = _batch(query_lens, context_lens, 6, 2, 16, 8, dtype,
                                                  DEVICE, pad_tokens=2)
    scale = 0.25
    with poisoned_allocations(prefill_attention):
        out, lse = prefill_attention.paged_attention(q, kv_layer, block_tables, qsl, lens, scale,
                                                     return_lse=True)
    expected, expected_lse = ref.paged_attention(q.float(), kv_layer.float(), block_tables, qsl,
                                                 lens, scale, return_lse=True)
    rows = int(qsl[-1])
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert rel_error(out[:rows], expected[:rows]) < (1e-5 if dtype == torch.float32 else 2e-3)
    torch.testing.assert_close(lse[:rows], expected_lse[:rows], atol=1e-4, rtol=1e-4)


def _prefill_at_boundaries(group, block_m, block_n, dtype, device):
    """(out, lse, expected float32, expected_lse): cached context around the 16-token blocks
    and the key tiles, new tokens that cross them; 2 KV heads of `group` q heads each."""
    context_lens, query_lens = [0, 1, 15, 16, 17, 63, 64, 65], [17, 15, 2, 1, 16, 1, 3, 20]
    q, kv_layer, block_tables, qsl, lens = _batch(query_lens, context_lens, 2 * group, 2, 16, 16,
                                                  dtype, device, seed=group)
    config = prefill_attention.PrefillConfig(block_m, block_n, num_warps=4, num_stages=2)
    with poisoned_allocations(prefill_attention):
        out, lse = prefill_attention._launch(q, kv_layer, block_tables, qsl, lens, 0.25, True,
                                             config)
    expected, expected_lse = ref.paged_attention(q.float(), kv_layer.float(), block_tables, qsl,
                                                 lens, 0.25, return_lse=True)
    return out, lse, expected, expected_lse


BOUNDARY_CONFIGS = [(16, 16), (64, 64)]  # (block_m, block_n)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_m,block_n", BOUNDARY_CONFIGS)
def test_prefill_at_tile_and_block_boundaries(group, block_m, block_n):
    out, lse, expected, expected_lse = _prefill_at_boundaries(group, block_m, block_n,
                                                              torch.float32, DEVICE)
    assert rel_error(out, expected) < 1e-5
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)


def test_prefill_without_lse_and_wide_group():
    q, kv_layer, block_tables, qsl, lens = _batch([5, 3], [2, 40], 32, 1, 16, 16, torch.float32,
                                                  DEVICE, seed=1)
    out = prefill_attention.paged_attention(q, kv_layer, block_tables, qsl, lens, 0.3,
                                            max_query_len=5)
    expected = ref.paged_attention(q, kv_layer, block_tables, qsl, lens, 0.3)
    assert isinstance(out, torch.Tensor)
    assert rel_error(out, expected) < 1e-5


def _scattered(dtype, device, seed=0):
    """Two sequences whose new tokens are scattered positions of theirs (every key cached),
    ascending, crossing blocks and key tiles, and a third whose new tokens are its last ones."""
    positions = [[0, 3, 4, 5, 17, 40, 41, 63, 64, 90], [2, 9, 33], [25, 26, 27]]
    seq_lens = [91, 40, 28]
    query_lens = [len(p) for p in positions]
    q, kv_layer, block_tables, qsl, lens = _batch(query_lens, [n - q for n, q in zip(seq_lens, query_lens)],
                                                  6, 2, 16, 8, dtype, device, seed=seed)
    flat = torch.tensor([p for ps in positions for p in ps], dtype=torch.int32, device=device)
    return q, kv_layer, block_tables, qsl, lens, flat


def test_reference_query_positions_attend_each_token_to_its_own_prefix():
    q, kv_layer, block_tables, qsl, lens, positions = _scattered(torch.float32, "cpu")
    out, lse = ref.paged_attention(q, kv_layer, block_tables, qsl, lens, 0.25, return_lse=True,
                                   query_positions=positions)
    for row in range(len(positions)):  # each token alone: a sequence of its position + 1 tokens
        seq = int(torch.searchsorted(qsl, torch.tensor(row, dtype=torch.int32), right=True)) - 1
        alone, alone_lse = ref.paged_attention(
            q[row:row + 1], kv_layer, block_tables[seq:seq + 1],
            torch.tensor([0, 1], dtype=torch.int32), positions[row:row + 1] + 1, 0.25, return_lse=True)
        torch.testing.assert_close(out[row], alone[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(lse[row], alone_lse[0], atol=1e-6, rtol=1e-5)
    # The last tokens' own positions give what the default placement gives.
    last = torch.cat([torch.arange(int(n) - int(b - a), int(n)) for a, b, n in zip(qsl[:-1], qsl[1:], lens)])
    torch.testing.assert_close(
        ref.paged_attention(q, kv_layer, block_tables, qsl, lens, 0.25, query_positions=last.int()),
        ref.paged_attention(q, kv_layer, block_tables, qsl, lens, 0.25))


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("block_m,block_n", BOUNDARY_CONFIGS)
def test_prefill_with_query_positions_matches_reference(dtype, block_m, block_n):
    q, kv_layer, block_tables, qsl, lens, positions = _scattered(dtype, DEVICE, seed=3)
    config = prefill_attention.PrefillConfig(block_m, block_n, num_warps=4, num_stages=2)
    with poisoned_allocations(prefill_attention):
        out, lse = prefill_attention._launch(q, kv_layer, block_tables, qsl, lens, 0.25, True, config,
                                             positions)
    expected, expected_lse = ref.paged_attention(q.float(), kv_layer.float(), block_tables, qsl, lens,
                                                 0.25, return_lse=True, query_positions=positions)
    assert rel_error(out, expected) < (1e-5 if dtype == torch.float32 else 2e-3)
    torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-4)
    checked = prefill_attention.paged_attention(q, kv_layer, block_tables, qsl, lens, 0.25,
                                                query_positions=positions)
    torch.testing.assert_close(checked, out)


def test_wrapper_rejects_bad_inputs():
    q, kv_layer, block_tables, qsl, lens = _batch([2], [1], 2, 1, 16, 4, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="query_start_loc"):
        prefill_attention.paged_attention(q, kv_layer, block_tables, qsl[:1], lens, 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        prefill_attention.paged_attention(q, kv_layer, block_tables, qsl, lens.long(), 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        prefill_attention.paged_attention(q[..., :8], kv_layer, block_tables, qsl, lens, 1.0)
    with pytest.raises(ValueError, match="query_positions"):
        prefill_attention.paged_attention(q, kv_layer, block_tables, qsl, lens, 1.0,
                                          query_positions=torch.tensor([0, 1, 2], dtype=torch.int32))


@gpu
@skip_without_cuda
@pytest.mark.parametrize("config", [None, *prefill_attention.CANDIDATE_CONFIGS], ids=str)
def test_prefill_bf16_llama_shapes(config):
    query_lens, context_lens = [512, 300, 1, 1000], [0, 1024, 2000, 17]
    q, kv_layer, block_tables, qsl, lens = _batch(query_lens, context_lens, 32, 8, 128, 16,
                                                  torch.bfloat16, "cuda")
    if config is None:
        out, lse = prefill_attention.paged_attention(q, kv_layer, block_tables, qsl, lens,
                                                     128 ** -0.5, return_lse=True)
    else:  # a config the benchmark sweeps
        out, lse = prefill_attention._launch(q, kv_layer, block_tables, qsl, lens, 128 ** -0.5,
                                             True, config)
    expected, expected_lse = ref.paged_attention(q.float(), kv_layer.float(), block_tables, qsl,
                                                 lens, 128 ** -0.5, return_lse=True)
    assert torch.isfinite(out).all()
    assert cosine(out, expected) > 0.99
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=3e-2, rtol=1e-2)


@gpu
@skip_without_cuda
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_m,block_n", BOUNDARY_CONFIGS)
def test_prefill_bf16_at_tile_and_block_boundaries(group, block_m, block_n):
    out, lse, expected, expected_lse = _prefill_at_boundaries(group, block_m, block_n,
                                                              torch.bfloat16, "cuda")
    assert torch.isfinite(out).all()
    assert cosine(out, expected) > 0.99
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=3e-2, rtol=1e-2)


@gpu
@skip_without_cuda
def test_prefill_bf16_with_query_positions_at_llama_shapes():
    """A fifth of a 4,096-token prompt's tokens, scattered, recomputed over its cached keys."""
    g = torch.Generator().manual_seed(7)
    positions = torch.randperm(4096, generator=g)[:820].sort().values.int().cuda()
    q, kv_layer, block_tables, _, _ = _batch([820], [4096 - 820], 32, 8, 128, 16, torch.bfloat16, "cuda")
    qsl = torch.tensor([0, 820], dtype=torch.int32, device="cuda")
    lens = torch.tensor([4096], dtype=torch.int32, device="cuda")
    out, lse = prefill_attention.paged_attention(q, kv_layer, block_tables, qsl, lens, 128 ** -0.5,
                                                 return_lse=True, query_positions=positions)
    expected, expected_lse = ref.paged_attention(q.float(), kv_layer.float(), block_tables, qsl, lens,
                                                 128 ** -0.5, return_lse=True, query_positions=positions)
    assert torch.isfinite(out).all()
    assert cosine(out, expected) > 0.99
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=3e-2, rtol=1e-2)

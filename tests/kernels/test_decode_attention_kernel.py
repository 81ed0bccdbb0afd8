import pytest
import torch

from loraplex.kernels import decode_attention
from loraplex.kernels import reference as ref
from tests.kernels.kernel_testing import (
    DEVICE,
    INTERPRETER_DTYPES,
    cosine,
    gpu,
    guarded_1d,
    make_paged_kv,
    poisoned_allocations,
    rel_error,
    skip_without_cuda,
)


def _query(batch, num_heads, head_dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, num_heads, head_dim, generator=g).to(device, dtype)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_matches_reference_with_gqa_and_padding(dtype, num_splits):
    seq_lens = [0, 1, 19, 70]  # padding row, a lone token, lengths off the block size
    head_dim, num_heads, num_kv_heads = 32, 8, 2
    kv_layer, block_tables = make_paged_kv(seq_lens, num_kv_heads, head_dim, 8, dtype, DEVICE,
                                           extra_blocks=1)
    q = _query(len(seq_lens), num_heads, head_dim, dtype, DEVICE)
    lens = guarded_1d(torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE))
    scale = head_dim ** -0.5
    with poisoned_allocations(decode_attention):
        out = decode_attention.paged_decode_attention(q, kv_layer, block_tables, lens, scale,
                                                      num_splits=num_splits)
    expected = ref.paged_decode_attention(q.float(), kv_layer.float(), block_tables, lens, scale)
    assert out.dtype == dtype
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert rel_error(out, expected) < (1e-5 if dtype == torch.float32 else 2e-3)


def _decode_at_boundaries(group, block_n, num_splits, dtype, device):
    """(out, expected float32) at lengths around the 16-token blocks, the 16- and 64-token
    tiles and the splits' chunks, for 2 KV heads of `group` q heads each."""
    seq_lens = [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 128]
    kv_layer, block_tables = make_paged_kv(seq_lens, 2, 16, 16, dtype, device, seed=group)
    q = _query(len(seq_lens), 2 * group, 16, dtype, device, seed=group)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    config = decode_attention.DecodeConfig(num_splits, block_n, num_warps=4, num_stages=2)
    with poisoned_allocations(decode_attention):
        out = decode_attention._launch(q, kv_layer, block_tables, lens, 0.25, config)
    return out, ref.paged_decode_attention(q.float(), kv_layer.float(), block_tables, lens, 0.25)


BOUNDARY_CONFIGS = [(64, 1), (16, 1), (16, 3)]  # (block_n, num_splits)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_n,num_splits", BOUNDARY_CONFIGS)
def test_decode_at_tile_and_block_boundaries(group, block_n, num_splits):
    out, expected = _decode_at_boundaries(group, block_n, num_splits, torch.float32, DEVICE)
    assert rel_error(out, expected) < 1e-5


def test_decode_head_dim_not_a_power_of_two_and_wide_group():
    seq_lens = [5, 33]
    kv_layer, block_tables = make_paged_kv(seq_lens, 1, 24, 4, torch.float32, DEVICE, seed=1)
    q = _query(2, 20, 24, torch.float32, DEVICE, seed=1)  # group of 20 > 16 rows
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention.paged_decode_attention(q, kv_layer, block_tables, lens, 0.3,
                                                  num_splits=2)
    expected = ref.paged_decode_attention(q, kv_layer, block_tables, lens, 0.3)
    assert rel_error(out, expected) < 1e-5


def test_split_count_is_a_function_of_shapes():
    cpu = torch.device("cpu")
    a = decode_attention.decode_config(64, 8, 2048, 128, cpu)
    assert a == decode_attention.decode_config(64, 8, 2048, 128, cpu)
    assert a.num_splits >= 1
    # Few programs get more splits, long enough splits only.
    assert decode_attention.decode_config(1, 1, 4096, 128, cpu).num_splits > 1
    assert decode_attention.decode_config(1, 1, 64, 128, cpu).num_splits == 1


def test_wrapper_rejects_bad_inputs():
    kv_layer, block_tables = make_paged_kv([4], 2, 16, 4, torch.float32, DEVICE)
    q = _query(1, 4, 16, torch.float32, DEVICE)
    lens = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention.paged_decode_attention(q, kv_layer, block_tables, lens.long(), 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        decode_attention.paged_decode_attention(q, kv_layer, block_tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention.paged_decode_attention(q[:, :3], kv_layer, block_tables, lens, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        decode_attention.paged_decode_attention(q.half(), kv_layer, block_tables, lens, 1.0)


@gpu
@skip_without_cuda
@pytest.mark.parametrize("batch,context", [(64, 2048), (3, 4000)])
def test_decode_bf16_llama_shapes(batch, context):
    g = torch.Generator().manual_seed(batch)
    seq_lens = torch.randint(context // 2, context + 1, (batch,), generator=g).tolist()
    seq_lens[0] = context
    if batch > 3:
        seq_lens[1] = 0
    kv_layer, block_tables = make_paged_kv(seq_lens, 8, 128, 16, torch.bfloat16, "cuda",
                                           num_layers=1, layer=0)
    q = _query(batch, 32, 128, torch.bfloat16, "cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = decode_attention.paged_decode_attention(q, kv_layer, block_tables, lens, 128 ** -0.5)
    expected = ref.paged_decode_attention(q.float(), kv_layer.float(), block_tables, lens,
                                          128 ** -0.5)
    assert torch.isfinite(out).all()
    assert cosine(out, expected) > 0.99
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=0)


@gpu
@skip_without_cuda
@pytest.mark.parametrize("config", decode_attention.CANDIDATE_CONFIGS, ids=str)
def test_decode_bf16_candidate_configs(config):
    seq_lens = [2048, 1, 0, 777, 1500, 16, 2047, 129]
    kv_layer, block_tables = make_paged_kv(seq_lens, 8, 128, 16, torch.bfloat16, "cuda",
                                           num_layers=1, layer=0)
    q = _query(len(seq_lens), 32, 128, torch.bfloat16, "cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = decode_attention._launch(q, kv_layer, block_tables, lens, 128 ** -0.5, config)
    expected = ref.paged_decode_attention(q.float(), kv_layer.float(), block_tables, lens,
                                          128 ** -0.5)
    assert torch.isfinite(out).all() and torch.equal(out[2], torch.zeros_like(out[2]))
    assert cosine(out, expected) > 0.99
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=0)


@gpu
@skip_without_cuda
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_n,num_splits", BOUNDARY_CONFIGS)
def test_decode_bf16_at_tile_and_block_boundaries(group, block_n, num_splits):
    out, expected = _decode_at_boundaries(group, block_n, num_splits, torch.bfloat16, "cuda")
    assert torch.isfinite(out).all()
    assert cosine(out, expected) > 0.99
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=0)

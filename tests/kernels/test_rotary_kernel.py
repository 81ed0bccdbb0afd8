import pytest
import torch

from loraplex.kernels import reference as ref
from loraplex.kernels import rotary
from tests.kernels.kernel_testing import (
    DEVICE,
    INTERPRETER_DTYPES,
    as_pool_offsets,
    assert_close_bf16,
    gpu,
    guarded_1d,
    poisoned_allocations,
    skip_without_cuda,
)


def _cos_sin(max_positions, head_dim, device):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


def _case(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=0,
          num_layers=2):
    """Strided q/k/v views of one fused qkv row, and a multi-layer cache poisoned with NaN."""
    g = torch.Generator().manual_seed(seed)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=g).to(device, dtype)
    q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    num_blocks = 2 * (num_tokens // block_size + 2)
    cache = torch.full((num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim),
                       float("nan"), dtype=dtype, device=device)
    positions = torch.randint(0, 64, (num_tokens,), generator=g).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::3] = -1  # padding tokens store nothing
    return positions, q, k, v, cache, slots.to(device)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("head_dim", [16, 24])
def test_rotary_store_kv_matches_reference(dtype, head_dim):
    positions, q, k, v, cache, slots = _case(7, 4, 2, head_dim, 4, dtype, DEVICE)
    cos_sin = _cos_sin(64, head_dim, DEVICE)
    expected_cache = cache.clone()
    expected_q = ref.rotary_store_kv(positions, q, k, v, cos_sin, expected_cache[:, 1], slots)
    positions_g, slots_g = guarded_1d(positions), guarded_1d(slots)
    with poisoned_allocations(rotary):
        out_q = rotary.rotary_store_kv(positions_g, q, k, v, cos_sin, cache[:, 1], slots_g)
    assert out_q.is_contiguous() and out_q.shape == q.shape
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(out_q, expected_q, atol=tol, rtol=tol)
    # Written slots match; every other slot of every layer is still NaN.
    torch.testing.assert_close(cache, expected_cache, atol=tol, rtol=tol, equal_nan=True)
    written = slots[slots >= 0]
    assert torch.isfinite(cache[:, 1].permute(0, 2, 1, 3, 4).flatten(0, 1)[written]).all()


def test_all_padding_writes_nothing():
    positions, q, k, v, cache, slots = _case(3, 2, 1, 16, 4, torch.float32, DEVICE)
    slots[:] = -1
    rotary.rotary_store_kv(positions, q, k, v, _cos_sin(64, 16, DEVICE), cache[:, 0], slots)
    assert torch.isnan(cache).all()


def test_wrapper_rejects_bad_inputs():
    positions, q, k, v, cache, slots = _case(3, 2, 1, 16, 4, torch.float32, DEVICE)
    cos_sin = _cos_sin(64, 16, DEVICE)
    with pytest.raises(ValueError, match="kv_layer"):
        rotary.rotary_store_kv(positions, q, k, v, cos_sin, cache[:, 0, :, :2], slots)
    with pytest.raises(ValueError, match="dense"):
        rotary.rotary_store_kv(positions, q, k, v, cos_sin, cache[:, 0].transpose(2, 3), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary.rotary_store_kv(positions, q, k, v, cos_sin, cache[:, 0], slots[:2])
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary.rotary_store_kv(positions, q, k, v, cos_sin[:, :8], cache[:, 0], slots)
    with pytest.raises(ValueError, match="v"):
        rotary.rotary_store_kv(positions, q, k, v.half(), cos_sin, cache[:, 0], slots)


@gpu
@skip_without_cuda
@pytest.mark.parametrize("num_tokens", [64, 4096])
def test_rotary_store_kv_bf16_llama_shapes(num_tokens):
    positions, q, k, v, cache, slots = _case(num_tokens, 32, 8, 128, 16, torch.bfloat16, "cuda",
                                             num_layers=1)
    positions = torch.randint(0, 8192, (num_tokens,), device="cuda")
    cos_sin = _cos_sin(8192, 128, "cuda")
    expected_cache = cache.float()
    out_q = rotary.rotary_store_kv(positions, q, k, v, cos_sin, cache[:, 0], slots)
    expected_q = ref.rotary_store_kv(positions, q.float(), k.float(), v.float(), cos_sin,
                                     expected_cache[:, 0], slots)
    assert_close_bf16(out_q, expected_q, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(cache.float(), expected_cache, atol=1e-2, rtol=1e-2, equal_nan=True)


def _ia3_scales(num_slots, width, scaled_slots, device, seed=9):
    """IA3 vectors [num_slots, width] (NaN in the rows of slots that set no flag: never read)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.full((num_slots, width), float("nan"))
    scaled = torch.zeros(num_slots, dtype=torch.int32)
    for slot in scaled_slots:
        scale[slot] = 1 + 0.5 * torch.randn(width, generator=g)
        scaled[slot] = 1
    return scale.to(device), scaled.to(device)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
def test_rotary_store_kv_applies_ia3_vectors(dtype):
    """q | k | v of the tokens whose slot is scaled are multiplied by the slot's vector first,
    as if the projection's output had been; other tokens are as without vectors."""
    head_dim = 16
    positions, q, k, v, cache, slots = _case(7, 4, 2, head_dim, 4, dtype, DEVICE)
    cos_sin = _cos_sin(64, head_dim, DEVICE)
    token_slots = torch.tensor([0, 1, 3, 1, 2, 0, 3], dtype=torch.int32, device=DEVICE)
    scale, scaled = _ia3_scales(4, (4 + 2 * 2) * head_dim, (1, 3), DEVICE)
    expected_cache = cache.clone()
    expected_q = ref.rotary_store_kv(positions, q, k, v, cos_sin, expected_cache[:, 1], slots,
                                     token_slots, scale, scaled)
    with poisoned_allocations(rotary):
        out_q = rotary.rotary_store_kv(guarded_1d(positions), q, k, v, cos_sin, cache[:, 1],
                                       guarded_1d(slots), guarded_1d(token_slots), scale, scaled)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(out_q, expected_q, atol=tol, rtol=tol)
    torch.testing.assert_close(cache, expected_cache, atol=tol, rtol=tol, equal_nan=True)
    # The oracle: scaling q, k, v by hand, then the plain op.
    qkv = torch.cat([t.reshape(7, -1) for t in (q, k, v)], dim=1).float()
    on = scaled[token_slots.long()].bool().unsqueeze(1)
    qkv = torch.where(on, qkv * scale[token_slots.long()], qkv).to(dtype)
    q2, k2, v2 = qkv.split((4 * head_dim, 2 * head_dim, 2 * head_dim), dim=1)
    plain_cache = torch.full_like(cache, float("nan"))
    plain_q = ref.rotary_store_kv(positions, q2.reshape(q.shape), k2.reshape(k.shape), v2.reshape(v.shape),
                                  cos_sin, plain_cache[:, 1], slots)
    torch.testing.assert_close(out_q, plain_q, atol=tol, rtol=tol)
    torch.testing.assert_close(cache[:, 1], plain_cache[:, 1], atol=tol, rtol=tol, equal_nan=True)
    assert not torch.allclose(out_q[1], ref.rotary_store_kv(positions, q, k, v, cos_sin, cache[:, 0].clone(),
                                                            slots)[1], atol=1e-2)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
def test_rotary_store_kv_reads_ia3_vectors_at_pool_offsets(dtype):
    """Paged adapters: the vectors at int64 offsets of the pool (-1: none) give exactly what the
    same vectors as dense rows give, in the kernel and in the reference."""
    head_dim = 16
    positions, q, k, v, cache, slots = _case(7, 4, 2, head_dim, 4, dtype, DEVICE)
    cos_sin = _cos_sin(64, head_dim, DEVICE)
    token_slots = torch.tensor([0, 1, 3, 1, 2, 0, 3], dtype=torch.int32, device=DEVICE)
    scale, scaled = _ia3_scales(4, (4 + 2 * 2) * head_dim, (1, 3), DEVICE)
    pool, at = as_pool_offsets(scale, scaled)
    dense_cache, paged_cache, ref_cache = cache.clone(), cache.clone(), cache.clone()
    dense_q = rotary.rotary_store_kv(positions, q, k, v, cos_sin, dense_cache[:, 1], slots, token_slots,
                                     scale, scaled)
    with poisoned_allocations(rotary):
        paged_q = rotary.rotary_store_kv(guarded_1d(positions), q, k, v, cos_sin, paged_cache[:, 1],
                                         guarded_1d(slots), guarded_1d(token_slots), pool, guarded_1d(at))
    ref_q = ref.rotary_store_kv(positions, q, k, v, cos_sin, ref_cache[:, 1], slots, token_slots, pool, at)
    assert torch.equal(paged_q, dense_q)
    torch.testing.assert_close(paged_cache, dense_cache, atol=0, rtol=0, equal_nan=True)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(paged_q, ref_q, atol=tol, rtol=tol)
    torch.testing.assert_close(paged_cache, ref_cache, atol=tol, rtol=tol, equal_nan=True)


def test_rotary_store_kv_rejects_partial_ia3_arguments():
    positions, q, k, v, cache, slots = _case(3, 4, 2, 16, 4, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="together"):
        rotary.rotary_store_kv(positions, q, k, v, _cos_sin(64, 16, DEVICE), cache[:, 0], slots,
                               token_slots=torch.zeros(3, dtype=torch.int32, device=DEVICE))


@gpu
@skip_without_cuda
def test_rotary_store_kv_ia3_bf16_llama_shapes():
    positions, q, k, v, cache, slots = _case(64, 32, 8, 128, 16, torch.bfloat16, "cuda")
    cos_sin = _cos_sin(64, 128, "cuda")
    token_slots = (torch.arange(64, device="cuda", dtype=torch.int32) % 5)
    scale, scaled = _ia3_scales(5, (32 + 16) * 128, (1, 2, 4), "cuda")
    expected_cache = cache.clone()
    expected_q = ref.rotary_store_kv(positions, q, k, v, cos_sin, expected_cache[:, 1], slots,
                                     token_slots, scale, scaled)
    out_q = rotary.rotary_store_kv(positions, q, k, v, cos_sin, cache[:, 1], slots, token_slots, scale,
                                   scaled)
    assert_close_bf16(out_q, expected_q, atol=2e-2, rtol=1e-2)
    assert_close_bf16(cache.nan_to_num(), expected_cache.nan_to_num(), atol=2e-2, rtol=1e-2)


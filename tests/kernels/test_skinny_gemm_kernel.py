import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from loraplex.kernels import reference as ref
from loraplex.kernels import skinny_gemm
from loraplex.kernels.skinny_gemm import SkinnyConfig, skinny_linear
from tests.kernels.kernel_testing import (
    DEVICE,
    INTERPRETER_DTYPES,
    assert_close_bf16,
    gpu,
    guarded_1d,
    guarded_rows,
    poisoned_allocations,
    rel_error,
    skip_without_cuda,
)

N = 40  # not a multiple of block_n (16): the last column tile is partial
# Every code path at tiny tiles: CUDA cores / tensor cores, one program per column tile or K
# split over several (through the float32 workspace and the split-sum launch).
PATHS = {
    "fma": SkinnyConfig(block_n=16, block_k=32, use_dot=False),
    "dot": SkinnyConfig(block_n=16, block_k=32, use_dot=True),
    "fma-split": SkinnyConfig(block_n=8, block_k=32, split_k=2, use_dot=False),
    "dot-split": SkinnyConfig(block_n=16, block_k=16, split_k=3, use_dot=True),
}


def _inputs(m, n, k, dtype, *, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, w, b


def _guarded_weight(w):
    """A contiguous copy of w [n, k] with poison before and after it."""
    return guarded_1d(w.flatten()).view(w.shape)


def _tol(dtype):
    # fp16: one ulp of the output (the interpreter truncates when it rounds to fp16)
    return dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=2e-3)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("k", [64, 72])  # a multiple of block_k; a ragged last step
def test_matches_reference_on_guarded_inputs(dtype, m, path, k):
    x, w, b = _inputs(m, N, k, dtype, seed=m * k)
    with poisoned_allocations(skinny_gemm):
        out = skinny_linear(guarded_rows(x), _guarded_weight(w), guarded_1d(b), PATHS[path])
    assert out.shape == (m, N) and out.dtype == dtype
    torch.testing.assert_close(out, ref.linear(x, w, b), **_tol(dtype))


@pytest.mark.parametrize("path", list(PATHS))
def test_without_bias(path):
    x, w, _ = _inputs(3, N, 72, torch.float32, seed=5, bias=False)
    with poisoned_allocations(skinny_gemm):
        out = skinny_linear(guarded_rows(x), w, None, PATHS[path])
    torch.testing.assert_close(out, ref.linear(x, w), **_tol(torch.float32))


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_default_config_matches_reference(dtype, m):
    x, w, b = _inputs(m, N, 72, dtype, seed=m)
    with poisoned_allocations(skinny_gemm):
        out = skinny_linear(guarded_rows(x), w, b)
    torch.testing.assert_close(out, ref.linear(x, w, b), **_tol(dtype))


def test_rows_up_to_max_m_on_the_dot_path():
    x, w, b = _inputs(skinny_gemm.MAX_M, 24, 48, torch.float32, seed=3)
    out = skinny_linear(guarded_rows(x), w, b, SkinnyConfig(block_n=16, block_k=16, use_dot=True))
    torch.testing.assert_close(out, ref.linear(x, w, b), **_tol(torch.float32))


def test_split_k_needs_no_zeroed_workspace_across_calls():
    """Each split stores its partial sums (one writer per element): poisoned workspaces and
    repeated calls give the same exact result."""
    x, w, b = _inputs(3, N, 72, torch.float32, seed=7)
    with poisoned_allocations(skinny_gemm):
        first = skinny_linear(x, w, b, PATHS["fma-split"])
        second = skinny_linear(x, w, b, PATHS["fma-split"])
    assert torch.equal(first, second)
    torch.testing.assert_close(first, ref.linear(x, w, b), **_tol(torch.float32))


def test_a_short_k_launches_fewer_splits_than_asked():
    config = SkinnyConfig(block_n=16, block_k=32, split_k=4)
    assert skinny_gemm.num_k_splits(72, config) == (3, 32)
    assert skinny_gemm.num_k_splits(16, config) == (1, 32)
    x, w, b = _inputs(2, N, 72, torch.float32, seed=9)
    torch.testing.assert_close(skinny_linear(x, w, b, config), ref.linear(x, w, b),
                               **_tol(torch.float32))


@pytest.mark.parametrize("m", [1, 4, 8, 32])
def test_every_candidate_config_matches_reference(m):
    k = 2048 + 40  # long enough for the 2-way splits, with a ragged end
    configs = skinny_gemm.candidate_configs(m, N, k)
    assert configs
    assert {c.use_dot for c in configs} == ({False} if m < 4 else {True} if m > 8 else {False, True})
    # float32 in the interpreter; 16-bit on a GPU, whose shared memory the tiles are sized for
    # (in float32 the largest tiles need more than an H100 has)
    dtype = torch.float32 if DEVICE.type == "cpu" else torch.float16
    x, w, b = _inputs(m, N, k, dtype, seed=m)
    expected = ref.linear(x, w, b)
    tol = dict(atol=1e-3, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-3)
    for config in configs:
        skinny_gemm.check_config(config)
        torch.testing.assert_close(skinny_linear(x, w, b, config), expected, **tol,
                                   msg=lambda text, c=config: f"{c}: {text}")


LLAMA_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                "down": (4096, 14336), "lm_head": (128256, 4096)}


def test_default_config_fills_an_h100_at_llama_shapes(monkeypatch):
    monkeypatch.setattr(skinny_gemm, "num_sms", lambda device: 132)
    for m in (1, 2, 4, 8, 16, 32):
        for n, k in LLAMA_SHAPES.values():
            config = skinny_gemm.default_config(m, n, k, DEVICE)
            skinny_gemm.check_config(config)
            assert config.use_dot == (m > skinny_gemm.MAX_FMA_M)
            assert config.split_k == 1  # at least 256 column tiles already
            assert -(-n // config.block_n) >= 132
    narrow = skinny_gemm.default_config(1, 1024, 4096, DEVICE)  # 64 column tiles: split K
    assert narrow.split_k == 4


def test_empty_shapes():
    x, w, b = _inputs(0, N, 72, torch.float32)
    assert skinny_linear(x, w, b).shape == (0, N)
    x, w, b = _inputs(2, N, 0, torch.float32)
    torch.testing.assert_close(skinny_linear(x, w, b), b.expand(2, N))


def test_wrapper_rejects_bad_inputs():
    x, w, b = _inputs(2, N, 32, torch.float32)
    with pytest.raises(ValueError, match="x must have 2 dims"):
        skinny_linear(x[0], w)
    with pytest.raises(ValueError, match="weight has shape"):
        skinny_linear(x, w[:, :16].contiguous())
    with pytest.raises(ValueError, match="weight must be one of"):
        skinny_linear(x, w.half())
    with pytest.raises(ValueError, match="bias must be one of"):
        skinny_linear(x, w, b.half())
    with pytest.raises(ValueError, match="bias has shape"):
        skinny_linear(x, w, b[:8])
    with pytest.raises(ValueError, match=f"at most {skinny_gemm.MAX_M} rows"):
        skinny_linear(torch.zeros(skinny_gemm.MAX_M + 1, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        skinny_linear(x, torch.zeros(64, N, device=DEVICE)[::2].t())
    with pytest.raises(ValueError, match="x must have unit stride"):
        skinny_linear(torch.zeros(2, 64, device=DEVICE)[:, ::2], w)
    with pytest.raises(ValueError, match="dot path needs"):
        skinny_linear(x, w, config=SkinnyConfig(block_n=8, block_k=32, use_dot=True))
    with pytest.raises(ValueError, match="power of 2"):
        skinny_linear(x, w, config=SkinnyConfig(block_n=24, block_k=32))
    with pytest.raises(ValueError, match="split_k"):
        skinny_linear(x, w, config=SkinnyConfig(block_n=16, block_k=32, split_k=0))


def compile_for_sm90() -> None:
    """Print `OK name regs=R stack=S shared=B` (or FAIL) for each launch the wrappers make at
    Llama-3-8B shapes with the default configs, one split-K launch and its split sum, compiled
    for the H100. Run with TRITON_INTERPRET unset."""
    from tests.kernels.compile_sm90 import BF16, F32, compile_kernel

    cpu = torch.device("cpu")
    seen = set()
    configs = [(m, skinny_gemm.default_config(m, 4096, 4096, cpu)) for m in (1, 2, 4, 8, 16, 32)]
    configs.append((1, SkinnyConfig(block_n=16, block_k=256, split_k=2)))
    for m, c in configs:
        partial = c.split_k > 1
        key = (skinny_gemm.block_m(m, c), c, partial)
        if key in seen:
            continue
        seen.add(key)
        args = dict(x_ptr=BF16, w_ptr=BF16, bias_ptr=BF16, out_ptr=F32 if partial else BF16, M=m,
                    N=4096, K=4096, k_per_split=skinny_gemm.num_k_splits(4096, c)[1],
                    stride_xm=4096, stride_wn=4096, stride_om=4096, stride_osplit=m * 4096)
        constexprs = dict(BLOCK_M=key[0], BLOCK_N=c.block_n, BLOCK_K=c.block_k, USE_DOT=c.use_dot,
                          EVEN_K=True, HAS_BIAS=False, IS_PARTIAL=partial, UPCAST=False,
                          INPUT_PRECISION="tf32", NUM_STAGES=c.num_stages)
        print(compile_kernel(f"skinny m={m} {c}", skinny_gemm._skinny_kernel, args, constexprs,
                             c.num_warps, c.num_stages), flush=True)
    print(compile_kernel("skinny sum splits", skinny_gemm._sum_splits_kernel, dict(
        part_ptr=F32, bias_ptr=BF16, out_ptr=BF16, N=4096, num_splits=2, stride_psplit=4096,
        stride_pm=4096, stride_om=4096), dict(HAS_BIAS=True, BLOCK=skinny_gemm.REDUCE_BLOCK), 4),
        flush=True)


TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@pytest.mark.skipif(not (TOOLS / "ptxas").exists() or not (TOOLS / "cuobjdump").exists(),
                    reason="this triton has no NVIDIA backend tools")
def test_default_configs_compile_for_sm90_without_spills():
    """The interpreter cannot see compile errors or register and shared-memory limits."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = env.get("TRITON_DEFAULT_FP_FUSION", "1")
    code = "from tests.kernels.test_skinny_gemm_kernel import compile_for_sm90; compile_for_sm90()"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) >= 6, done.stdout + done.stderr[-3000:]
    bad = [line for line in lines if not line.startswith("OK ") or "stack=0" not in line]
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------- GPU, bf16


def _bf16_inputs(m, n, k, *, seed=0, bias=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16) * 0.1 if bias else None
    return x, w, b


def _expected(x, w, b):
    return ref.linear(x.float(), w.float(), None if b is None else b.float())


@gpu
@skip_without_cuda
@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("shape", list(LLAMA_SHAPES))
def test_bf16_llama_shapes(shape, m):
    n, k = LLAMA_SHAPES[shape]
    x, w, b = _bf16_inputs(m, n, k, seed=m, bias=shape == "qkv")
    out = skinny_linear(x, w, b)
    expected = _expected(x, w, b)
    assert out.dtype == torch.bfloat16
    assert rel_error(out, expected) < 1e-2
    assert_close_bf16(out, expected, atol=2e-2, rtol=2e-2)


@gpu
@skip_without_cuda
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 32])
def test_bf16_every_candidate_config(m):
    n, k = LLAMA_SHAPES["o"]
    x, w, _ = _bf16_inputs(m, n, k, seed=m)
    expected = _expected(x, w, None)
    failed = [(c, rel_error(skinny_linear(x, w, None, c), expected))
              for c in skinny_gemm.candidate_configs(m, n, k)]
    failed = [(c, err) for c, err in failed if not err < 1e-2]
    assert not failed


@gpu
@skip_without_cuda
@pytest.mark.parametrize("m", [1, 3, 16, 33, skinny_gemm.MAX_M])
@pytest.mark.parametrize("path", [*PATHS, "default"])
def test_bf16_ragged_shapes_and_strided_rows(m, path):
    n, k = 1000, 1008  # neither a multiple of the tiles (k of 32 or more); rows 16-byte aligned
    x, w, b = _bf16_inputs(m, n, k, seed=m, bias=True)
    config = None if path == "default" else PATHS[path]
    out = skinny_linear(guarded_rows(x, pad=8), w, b, config)
    assert rel_error(out, _expected(x, w, b)) < 1e-2


@gpu
@skip_without_cuda
@pytest.mark.parametrize("m, config", [
    (1, None), (16, None), (4, SkinnyConfig(block_n=16, block_k=256, split_k=4)),
    (8, SkinnyConfig(block_n=32, block_k=128, split_k=2, use_dot=True)),
])
def test_replays_in_a_cuda_graph_with_new_inputs(m, config):
    n, k = 4096, 4096
    x, w, b = _bf16_inputs(m, n, k, seed=1, bias=True)
    call = lambda: skinny_linear(x, w, b, config)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # compile and warm up off the default stream, as capture wants
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    for seed in (2, 3):
        x_new, w_new, b_new = _bf16_inputs(m, n, k, seed=seed, bias=True)
        x.copy_(x_new)
        w.copy_(w_new)
        b.copy_(b_new)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_error(captured, _expected(x_new, w_new, b_new)) < 1e-2
        torch.testing.assert_close(captured, skinny_linear(x_new, w_new, b_new, config), atol=0,
                                   rtol=0)


@pytest.mark.parametrize("path", ["fma", "dot-split"])
def test_float32_output_keeps_the_sums_unrounded(path):
    """Logits: 16-bit inputs, float32 out, not rounded to 16 bits on the way."""
    x, w, b = _inputs(3, N, 64, torch.float16, seed=5)
    out = skinny_linear(x, w, b, PATHS[path], out_dtype=torch.float32)
    assert out.dtype == torch.float32
    expected = ref.linear(x, w, b, out_dtype=torch.float32)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
    rounded = expected.half().float()
    assert (expected != rounded).any()  # so the check above could tell the two apart
    with pytest.raises(ValueError, match="out_dtype"):
        skinny_linear(x, w, b, PATHS[path], out_dtype=torch.int32)


def test_decode_config_follows_the_h100_measurements():
    fma, dot = skinny_gemm.FMA_DECODE, skinny_gemm.DOT_DECODE
    assert skinny_gemm.decode_config(1, 4096, 4096) == fma
    assert skinny_gemm.decode_config(2, 28672, 4096) == fma
    assert skinny_gemm.decode_config(4, 4096, 14336) is None  # cuBLAS from 4 rows
    assert skinny_gemm.decode_config(16, 128256, 4096) == dot  # except on a vocabulary
    assert skinny_gemm.decode_config(64, 128256, 4096) == skinny_gemm.DOT_DECODE_64
    assert skinny_gemm.decode_config(65, 128256, 4096) is None


def test_linear_off_cuda_is_torch():
    x, w, b = _inputs(2, N, 64, torch.float32, seed=6)
    x, w, b = x.cpu(), w.cpu(), b.cpu()
    torch.testing.assert_close(skinny_gemm.linear(x, w, b), torch.nn.functional.linear(x, w, b))
    assert skinny_gemm.linear(x, w, b, out_dtype=torch.float64).dtype == torch.float64


@gpu
@skip_without_cuda
@pytest.mark.parametrize("m", [1, 2, 3, 16, 33, 64, 65])
def test_bf16_linear_dispatch_at_decode_sizes(m):
    """What the model calls: every row count a decode graph may have, projections and logits."""
    for shape in ("o", "lm_head"):
        n, k = LLAMA_SHAPES[shape]
        x, w, _ = _bf16_inputs(m, n, k, seed=m)
        expected = _expected(x, w, None)
        out = skinny_gemm.linear(x, w)
        assert out.dtype == torch.bfloat16 and rel_error(out, expected) < 1e-2
        logits = skinny_gemm.linear(x, w, out_dtype=torch.float32)
        assert logits.dtype == torch.float32 and rel_error(logits, expected) < 1e-2


@gpu
@skip_without_cuda
@pytest.mark.parametrize("m", [65, 300])
def test_float32_logits_past_the_skinny_sizes_are_not_rounded(m):
    """Past the skinny kernel's rows (cuBLAS), float32 logits of bf16 inputs are the float32
    accumulator, not bf16 results widened: prompt scoring reads them."""
    n, k = LLAMA_SHAPES["lm_head"]
    x, w, _ = _bf16_inputs(m, n, k, seed=m)
    logits = skinny_gemm.linear(x, w, out_dtype=torch.float32)
    exact = x.double() @ w.double().t()
    assert logits.dtype == torch.float32
    assert (logits.double() - exact).abs().max() < 1e-3
    assert not torch.equal(logits, logits.bfloat16().float())  # not bf16 values

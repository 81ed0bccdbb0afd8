"""Compile every Triton kernel for the H100 (sm_90) on a machine without a GPU, with the
launch configs the wrappers pick at Llama-3-8B shapes, and print one line per kernel:
`OK name regs=R stack=S shared=B` or `FAIL name: error`. ptxas and cuobjdump come with the
triton wheel. Run as `python -m tests.kernels.compile_sm90` with TRITON_INTERPRET unset (the
interpreter replaces the kernels it decorates)."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from loraplex.kernels import activation, lora, norm, rotary, sampling
from loraplex.kernels import decode_attention as decode
from loraplex.kernels import prefill_attention as prefill
from loraplex.kernels import relay_attention as relay

TARGET = GPUTarget("cuda", 90, 32)
BF16, F32, I32, I64 = "*bf16", "*fp32", "*i32", "*i64"
KV_STRIDES = dict(stride_kv_block=32 * 2 * 16 * 8 * 128, stride_kv_kv=16 * 8 * 128,
                  stride_kv_tok=8 * 128, stride_kv_head=128)


def _signature(fn, args: dict, constexprs: dict) -> tuple[dict, dict]:
    """Types of the runtime arguments, and the 16-divisibility the JIT would see for aligned
    pointers and multiples of 16 (it decides vector widths and software pipelining)."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        value = args[name]
        if isinstance(value, str):
            sig[name] = value
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            sig[name] = "i64" if abs(value) >= 2**31 else "i32"
        if isinstance(value, str) or (isinstance(value, int) and value % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _resources(cubin: bytes) -> tuple[str, str]:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        info = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", info), re.search(r"STACK:(\d+)", info)
    return (regs.group(1) if regs else "?"), (stack.group(1) if stack else "?")


def compile_kernel(name: str, fn, args: dict, constexprs: dict, num_warps: int,
                   num_stages: int = 2) -> str:
    sig, attrs = _signature(fn, args, constexprs)
    try:
        kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs),
                                target=TARGET,
                                options={"num_warps": num_warps, "num_stages": num_stages})
    except Exception as e:  # report, and go on with the other kernels
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"FAIL {name}: {first}"
    regs, stack = _resources(kernel.asm["cubin"])
    return f"OK {name} regs={regs} stack={stack} shared={kernel.metadata.shared}"


def _cases() -> Iterator[tuple]:
    norm_args = dict(x_ptr=BF16, residual_ptr=BF16, weight_ptr=BF16, out_ptr=BF16,
                     residual_out_ptr=BF16, hidden=4096, stride_x=4096, stride_residual=4096,
                     stride_out=4096, stride_residual_out=4096, eps=1e-5)
    for fused in (True, False):
        yield (f"rms_norm fused={fused}", norm._rms_norm_kernel, norm_args,
               dict(HAS_RESIDUAL=fused, BLOCK=4096), 8)
    # with IA3's q/k/v vectors: as dense rows and flags, or at pool offsets (paged adapters)
    for has_scale, offsets in ((False, False), (True, False), (True, True)):
        yield (f"rotary_store_kv ia3={has_scale} offsets={offsets}", rotary._rotary_store_kv_kernel, dict(
            positions_ptr=I64, q_ptr=BF16, k_ptr=BF16, v_ptr=BF16, cos_sin_ptr=F32, kv_ptr=BF16,
            slots_ptr=I64, q_out_ptr=BF16, token_slots_ptr=I32, scale_ptr=F32,
            scaled_ptr=I64 if offsets else I32,
            stride_q_tok=6144, stride_q_head=128, stride_k_tok=6144,
            stride_k_head=128, stride_v_tok=6144, stride_v_head=128, stride_cos_sin=128,
            **KV_STRIDES, stride_q_out_tok=4096, stride_q_out_head=128, stride_scale=6144,
            num_heads=32, num_kv_heads=8, half=64, block_size=16),
            dict(BLOCK_H=32, BLOCK_KV_H=8, BLOCK_HALF=64, HAS_SCALE=has_scale, OFFSETS=offsets), 4)
    base = decode.decode_config(64, 8, 2048, 128, _cpu())  # one split at batch 64
    decode_args = dict(
        q_ptr=BF16, kv_ptr=BF16, block_tables_ptr=I32, seq_lens_ptr=I32, out_ptr=BF16,
        part_out_ptr=F32, part_lse_ptr=F32, kv_starts_ptr=I32, prefix_out_ptr=F32,
        prefix_lse_ptr=F32, stride_q_seq=4096, stride_q_head=128, **KV_STRIDES, stride_bt_seq=512,
        stride_out_seq=4096, stride_out_head=128, scale_log2=0.127, num_heads=32, group=4,
        head_dim=128)
    # plain; relay's own part with the prefix merged in its epilogue or in the reduction
    for splits, is_relay, prefix_splits in ((1, False, 1), (8, False, 1), (1, True, 2), (4, True, 2)):
        cfg = decode.DecodeConfig(splits, base.block_n, base.num_warps, base.num_stages)
        name = f"decode{' relay' if is_relay else ''} {cfg}"
        yield (name, decode._decode_split_kernel, decode_args,
               dict(PAGE_SIZE=16, NUM_SPLITS=cfg.num_splits, BLOCK_H=16, BLOCK_N=cfg.block_n,
                    BLOCK_D=128, UPCAST=False, RELAY=is_relay, PREFIX_SPLITS=prefix_splits),
               cfg.num_warps, cfg.num_stages)
    for is_relay in (False, True):
        yield (f"decode reduce{' relay' if is_relay else ''}", decode._decode_reduce_kernel, dict(
            part_out_ptr=F32, part_lse_ptr=F32, seq_lens_ptr=I32, out_ptr=BF16, kv_starts_ptr=I32,
            prefix_out_ptr=F32, prefix_lse_ptr=F32, stride_out_seq=4096, stride_out_head=128,
            num_heads=32, head_dim=128),
            dict(NUM_SPLITS=8, BLOCK_S=8, BLOCK_N=64, BLOCK_D=128, RELAY=is_relay, PREFIX_SPLITS=2,
                 BLOCK_PS=2), 4)
    for cfg in relay.CANDIDATE_CONFIGS:
        yield (f"relay prefix {cfg}", relay._relay_prefix_kernel, dict(
            q_ptr=BF16, kv_ptr=BF16, block_tables_ptr=I32, prefix_lens_ptr=I32, members_ptr=I32,
            group_starts_ptr=I32, part_out_ptr=F32, part_lse_ptr=F32, stride_q_seq=4096,
            stride_q_head=128, **KV_STRIDES, stride_bt_seq=512, scale_log2=0.127, max_groups=64,
            num_heads=32, group=4, head_dim=128),
            dict(PAGE_SIZE=16, NUM_SPLITS=cfg.num_splits, MEMBERS_PER_TILE=cfg.block_m // 4,
                 GROUP_P2=4, BLOCK_N=cfg.block_n, BLOCK_D=128, UPCAST=False),
            cfg.num_warps, cfg.num_stages)
    cfg = prefill.prefill_config(4, 128)
    for has_positions in (False, True):  # (a blend's recompute: each token at its own position)
        yield (f"prefill {cfg} positions={has_positions}", prefill._prefill_kernel, dict(
            q_ptr=BF16, kv_ptr=BF16, block_tables_ptr=I32, query_start_loc_ptr=I32, seq_lens_ptr=I32,
            positions_ptr=I32, out_ptr=BF16, lse_ptr=F32, stride_q_tok=4096, stride_q_head=128,
            **KV_STRIDES, stride_bt_seq=512, stride_out_tok=4096, stride_out_head=128, stride_lse_tok=32,
            scale_log2=0.127, num_seqs=4, group=4, head_dim=128),
            dict(PAGE_SIZE=16, RETURN_LSE=True, BLOCK_Q=cfg.block_m // 4, GROUP_P2=4,
                 HAS_POSITIONS=has_positions, BLOCK_N=cfg.block_n, BLOCK_D=128, UPCAST=False),
            cfg.num_warps, cfg.num_stages)
    yield from _lora_cases()
    # with IA3's gate/up and down-input vectors: dense rows and flags, or at pool offsets
    for has_scale, offsets in ((False, False), (True, False), (True, True)):
        flags = I64 if offsets else I32
        yield (f"silu_and_mul ia3={has_scale} offsets={offsets}", activation._silu_and_mul_kernel, dict(
            x_ptr=BF16, out_ptr=BF16, slots_ptr=I32, scale_ptr=F32, scaled_ptr=flags,
            in_scale_ptr=F32, in_scaled_ptr=flags, intermediate=14336, stride_x=28672,
            stride_out=14336, stride_scale=28672, stride_in_scale=14336),
            dict(HAS_SCALE=has_scale, BLOCK_SIZE=activation.BLOCK, OFFSETS=offsets), 4)
    yield ("sample", sampling._sample_kernel, dict(
        logits_ptr=F32, temperature_ptr=F32, top_k_ptr=I32, top_p_ptr=F32, seeds_ptr=I64,
        offsets_ptr=I64, out_ptr=I64, cand_val_ptr=F32, cand_idx_ptr=I32, vocab=128256,
        stride_row=128256), dict(MAX_CAND_=sampling.MAX_CAND, NUM_PIVOTS_=16,
                                 NUM_LEVELS_=sampling.NUM_LEVELS, BLOCK_SIZE=sampling.BLOCK), 8)


def _lora_cases() -> Iterator[tuple]:
    """The per-token LoRA candidates (the H100 picks among them) at qkv shapes, rank 16, and
    the tile path the wrappers pick for a 2048-token prefill chunk."""
    shrink_args = dict(x_ptr=BF16, a_ptr=BF16, token_slots_ptr=I32, ranks_ptr=I32, out_ptr=F32,
                       in_features=4096, stride_x_tok=4096, stride_a_slot=3 * 16 * 4096,
                       stride_a_slice=16 * 4096, stride_a_rank=4096, stride_ranks_slot=3,
                       stride_out_slice=64 * 16, stride_out_tok=16)
    for s in lora.CANDIDATE_SHRINK_CONFIGS:
        yield (f"lora shrink {s}", lora._shrink_rows_kernel, dict(shrink_args, max_rank=16),
               dict(BLOCK_R=s.block_r, BLOCK_K=s.block_k, EVEN_K=True, NUM_STAGES=s.num_stages),
               s.num_warps)
    s = lora.shrink_config(2048, 3, 4096, 16, _cpu())
    yield (f"lora shrink {s}", lora._shrink_tiles_kernel,
           dict(shrink_args, num_tokens=2048, k_per_split=1024, stride_out_slice=2048 * 16),
           dict(BLOCK_M=s.block_m, BLOCK_R=16, BLOCK_K=s.block_k, ATOMIC=True, UPCAST=False),
           s.num_warps, s.num_stages)
    expand_args = dict(y_ptr=BF16, shrunk_ptr=F32, b_ptr=BF16, token_slots_ptr=I32,
                       ranks_ptr=I32, out_features=6144, max_rank=16, off0=0, off1=4096,
                       off2=5120, off3=6144, off4=6144, stride_y_tok=6144,
                       stride_s_slice=64 * 16, stride_s_tok=16, stride_b_slot=6144 * 16,
                       stride_b_out=16, stride_ranks_slot=3, scale_ptr=F32, scaled_ptr=I32,
                       shift_ptr=F32, stride_scale_slot=6144, stride_shift_slot=6144)
    for num_tokens, configs in ((64, lora.CANDIDATE_EXPAND_CONFIGS),
                                (2048, [lora.expand_config(2048, 16)])):
        for e in configs:
            yield (f"lora expand {e}", lora._expand_kernel, dict(expand_args, num_tokens=num_tokens),
                   dict(BLOCK_M=e.block_m, BLOCK_N=e.block_n, RANK_CHUNK=lora.RANK_CHUNK,
                        EVEN_R=True, NUM_STAGES=e.num_stages, HAS_SCALE=True, HAS_SHIFT=True),
                   e.num_warps)
    yield from _family_cases()
    yield from _paged_cases()


def _family_cases() -> Iterator[tuple]:
    """IA3's input scaling and FLoRA's stacking and combining at Llama-3-8B's down and qkv."""
    from loraplex.kernels import adapter_families as fam

    yield ("scale rows", fam._scale_rows_kernel,
           dict(x_ptr=BF16, scales_ptr=F32, slots_ptr=I32, out_ptr=BF16, in_features=14336,
                stride_x=14336, stride_s=14336, stride_o=14336), dict(BLOCK=fam.BLOCK), 4)
    for per_slice in (False, True):
        block_rows = 16 + 64 if per_slice else 16 + 3 * 64
        yield (f"flora stack (per slice {per_slice})", fam._flora_stack_kernel,
               dict(x_ptr=BF16, a_ptr=BF16, flora_ranks_ptr=I32, row_tokens_ptr=I64, row_slots_ptr=I32,
                    row_ranks_ptr=I64, out_ptr=BF16, num_tokens=16, num_rows=64, block_rows=block_rows,
                    in_features=4096, stride_x=4096, stride_a_slot=3 * 16 * 4096,
                    stride_a_slice=16 * 4096, stride_a_rank=4096, stride_fr_slot=3, stride_o=4096),
               dict(PER_SLICE=per_slice, BLOCK=fam.BLOCK), 4)
        yield (f"flora combine (per slice {per_slice})", fam._flora_combine_kernel,
               dict(y_ptr=BF16, p_ptr=BF16, b_ptr=BF16, slots_ptr=I32, flora_ranks_ptr=I32,
                    bounds_ptr=I64, bias_ptr=BF16, num_tokens=16, num_rows=64, out_features=6144,
                    off1=4096, off2=5120, off3=6144, stride_y=6144, stride_b_slot=6144 * 16,
                    stride_b_rank=6144, stride_fr_slot=3),
               dict(PER_SLICE=per_slice, HAS_BIAS=True, RANK_BLOCK=16,
                    BLOCK=fam.COMBINE_ELEMENTS // 16), 4)


def _paged_cases() -> Iterator[tuple]:
    """The paged twins (lora_paged.py, adapter_families_paged.py) with the configs the wrappers
    pick at qkv shapes, rank 16: decode (64 tokens) and a 2048-token prefill chunk."""
    from loraplex.kernels import adapter_families_paged as famp
    from loraplex.kernels import lora_paged as paged

    pages = dict(stride_p_slot=3 * 2, stride_p_slice=2)
    shrink_args = dict(x_ptr=BF16, pool_ptr=BF16, a_pages_ptr=I64, token_slots_ptr=I32, ranks_ptr=I32,
                       out_ptr=F32, in_features=4096, stride_x_tok=4096, stride_ranks_slot=3,
                       stride_out_slice=64 * 16, stride_out_tok=16, **pages)
    s = lora.shrink_config(64, 3, 4096, 16, _cpu())
    for token_list in (False, True):  # (lora_paged.SPLIT_LONE: a tile-path step's lone tokens)
        yield (f"lora paged shrink {s} token_list={token_list}", paged._shrink_rows_kernel,
               dict(shrink_args, token_list_ptr=I32, max_rank=16),
               dict(PAGE_RANK=paged.PAGE_RANK, BLOCK_R=s.block_r, BLOCK_K=s.block_k, EVEN_K=True,
                    NUM_STAGES=s.num_stages, ALIGN=8, TOKEN_LIST=token_list), s.num_warps)
    s = lora.shrink_config(2048, 3, 4096, 16, _cpu())
    yield (f"lora paged shrink {s}", paged._shrink_tiles_kernel,
           dict(shrink_args, num_tokens=2048, k_per_split=1024, stride_out_slice=2048 * 16),
           dict(PAGE_RANK=paged.PAGE_RANK, BLOCK_M=s.block_m, BLOCK_R=16, BLOCK_K=s.block_k, ATOMIC=True,
                UPCAST=False, ALIGN=8), s.num_warps, s.num_stages)
    expand_args = dict(y_ptr=BF16, shrunk_ptr=F32, pool_ptr=BF16, b_pages_ptr=I64, token_slots_ptr=I32,
                       token_list_ptr=I32, ranks_ptr=I32, vectors_ptr=F32, scale_at_ptr=I64, shift_at_ptr=I64,
                       out_features=6144, off0=0, off1=4096, off2=5120, off3=6144, off4=6144,
                       stride_y_tok=6144, stride_s_slice=64 * 16, stride_s_tok=16, stride_ranks_slot=3,
                       **pages)
    for num_tokens, token_list in ((64, False), (64, True), (2048, False)):
        e = paged.paged_expand_config(num_tokens, 16)
        yield (f"lora paged expand {e} token_list={token_list}", paged._expand_kernel,
               dict(expand_args, num_tokens=num_tokens),
               dict(PAGE_RANK=paged.PAGE_RANK, BLOCK_M=e.block_m, BLOCK_N=e.block_n,
                    RANK_CHUNK=paged.expand_rank_chunk(e, 16), NUM_STAGES=e.num_stages,
                    HAS_SCALE=True, HAS_SHIFT=True, ALIGN=8, VEC_ALIGN=4, TOKEN_LIST=token_list),
               e.num_warps)
    yield ("scale rows paged", famp._scale_rows_kernel,
           dict(x_ptr=BF16, vectors_ptr=F32, scale_at_ptr=I64, slots_ptr=I32, out_ptr=BF16,
                in_features=14336, stride_x=14336, stride_o=14336), dict(BLOCK=famp.BLOCK), 4)
    for per_slice in (False, True):
        block_rows = 16 + 64 if per_slice else 16 + 3 * 64
        yield (f"flora stack paged (per slice {per_slice})", famp._flora_stack_kernel,
               dict(x_ptr=BF16, pool_ptr=BF16, a_pages_ptr=I64, flora_ranks_ptr=I32, row_tokens_ptr=I64,
                    row_slots_ptr=I32, row_ranks_ptr=I64, out_ptr=BF16, num_tokens=16, num_rows=64,
                    block_rows=block_rows, in_features=4096, stride_x=4096, stride_fr_slot=3,
                    stride_o=4096, **pages),
               dict(PAGE_RANK=paged.PAGE_RANK, PER_SLICE=per_slice, BLOCK=famp.BLOCK, ALIGN=8), 4)
        yield (f"flora combine paged (per slice {per_slice})", famp._flora_combine_kernel,
               dict(y_ptr=BF16, p_ptr=BF16, pool_ptr=BF16, b_pages_ptr=I64, slots_ptr=I32,
                    flora_ranks_ptr=I32, bounds_ptr=I64, bias_ptr=BF16, num_tokens=16, num_rows=64,
                    out_features=6144, off1=4096, off2=5120, off3=6144, stride_y=6144, stride_fr_slot=3,
                    **pages),
               dict(PAGE_RANK=paged.PAGE_RANK, PER_SLICE=per_slice, HAS_BIAS=True, RANK_BLOCK=16,
                    BLOCK=famp.COMBINE_ELEMENTS // 16, ALIGN=8, NUM_SLICES=3), 4)


def _cpu():
    import torch

    return torch.device("cpu")


def _compile_case(index: int) -> str:
    """The line for case `index` of `_cases()` (a worker process's task: kernels do not pickle)."""
    return compile_kernel(*next(itertools.islice(_cases(), index, None)))


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
    num_cases = sum(1 for _ in _cases())
    # One compile a core (ptxas and triton's passes are single-threaded), lines in case order.
    with ProcessPoolExecutor(os.cpu_count(), mp_context=multiprocessing.get_context("spawn")) as pool:
        for line in pool.map(_compile_case, range(num_cases)):
            print(line, flush=True)


if __name__ == "__main__":
    main()

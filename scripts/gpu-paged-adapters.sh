#!/usr/bin/env bash
# Adapters read through page tables (issue 27, step 2) on a lent GPU: the offline install, the
# GPU tests of the paged kernels (bf16 at Llama-3-8B shapes against the slot kernels, and the
# interpreter-sized tests run on the GPU), the sm_90 compile check of every kernel (no spills),
# then the paged-vs-slots benchmark: a decode step's adapter work on one layer, 64 tokens each
# with its own adapter, for LoRA, DoRA, IA3 and FLoRA, the ratio against the goal of 1.03.
# About 3 minutes after the install; each stage has a time limit, so a run cut short keeps what
# it got. Logs and JSON go to $OUT (else bench/results/issue-27/), the JSON also to bench/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/issue-27}
mkdir -p "$OUT" bench/results
export PYTHONUNBUFFERED=1

scripts/gpu-pass.sh install
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
echo "=== paged kernel tests ($(date -u +%H:%M:%S))"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lora_paged_kernel.py \
    2>&1 | tee "$OUT/paged-kernel-tests.log" | tail -15
echo "=== compile check sm_90 ($(date -u +%H:%M:%S))"
env -u TRITON_INTERPRET timeout 300 python3 -m tests.kernels.compile_sm90 \
    2>&1 | tee "$OUT/compile-sm90.log" | grep -E "paged|FAIL" | head -30
echo "=== paged vs slots ($(date -u +%H:%M:%S))"
timeout 240 python3 -m loraplex.benchmarks kernels --paged --out "$OUT" \
    2>&1 | tee "$OUT/kernels-paged.log" | tail -12
cp "$OUT"/kernels-paged-*.json bench/results/ 2>/dev/null || true
echo "=== done ($(date -u +%H:%M:%S))"

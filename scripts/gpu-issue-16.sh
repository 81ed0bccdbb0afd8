#!/usr/bin/env bash
# Issue 16 (adapter families) on a lent GPU: the offline install, the GPU tests of the family
# kernels and of a mixed LoRA/DoRA/IA3/FLoRA batch through the Triton path, then the
# decode-by-family benchmark (Llama-3-8B shape, bf16; batches 1, 16, 64; each family alone and
# all four mixed; FLoRA against LoRA over ranks 1, 4, 16). About 5 minutes; at most ~9
# (the stages have time limits: 150 s of tests, 360 s of benchmark).
# Logs and JSON go to $OUT (else bench/results/issue-16/), and the JSON also to bench/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/issue-16}
mkdir -p "$OUT" bench/results
export PYTHONUNBUFFERED=1

scripts/gpu-pass.sh install
echo "=== tests ($(date -u +%H:%M:%S))"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_adapter_families_kernel.py \
    tests/kernels/test_lora_kernel.py "tests/engine/test_adapter_families.py::test_mixed_families_on_the_gpu_kernels" \
    2>&1 | tee "$OUT/gpu-tests.log" | tail -30
echo "=== decode-families ($(date -u +%H:%M:%S))"
timeout 360 python3 -m loraplex.benchmarks decode-families --batch-sizes 1,16,64 --rank 16 --flora-rank 4 \
    --crossover-ranks 1,4,16 --prompt-len 256 --new-tokens 64 --out "$OUT" 2>&1 \
    | tee "$OUT/decode-families.log" | tail -60
cp "$OUT"/decode-families-*.json bench/results/ 2>/dev/null || true
echo "=== done ($(date -u +%H:%M:%S))"

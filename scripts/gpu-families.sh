#!/usr/bin/env bash
# Adapter families (first built for issue 16) on a lent GPU: the offline install, the GPU tests of the family
# kernels (DoRA/IA3 expand epilogue, FLoRA stack/combine, IA3 in the rotary and activation
# kernels) and of mixed batches through the Triton path and the decode graphs, then the
# FLoRA products benchmark (fused against per-slice products, 60 s at most), then the
# decode-by-family benchmark (Llama-3-8B shape, bf16, CUDA graphs with --flora-graphs' FLoRA
# graphs; batches 1, 16, 64; each family alone and all four mixed; FLoRA against LoRA over ranks
# 1, 4, 16: the crossover). About 4 minutes after the install; the stages have time limits (90 s
# of tests, 60 s and 240 s of benchmark), and the families JSON is rewritten after every row,
# so a run cut short keeps what it measured.
# Logs and JSON go to $OUT (else bench/results/issue-16/), and the JSON also to bench/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/issue-16}
mkdir -p "$OUT" bench/results
export PYTHONUNBUFFERED=1

scripts/gpu-pass.sh install
echo "=== tests ($(date -u +%H:%M:%S))"
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_adapter_families_kernel.py \
    tests/kernels/test_rotary_kernel.py tests/kernels/test_activation_kernel.py \
    "tests/engine/test_adapter_families.py::test_mixed_families_on_the_gpu_kernels" \
    2>&1 | tee "$OUT/gpu-tests.log" | tail -30
echo "=== flora-products ($(date -u +%H:%M:%S))"
timeout 60 python3 -m loraplex.benchmarks flora-products --out "$OUT" 2>&1 | tee "$OUT/flora-products.log" | tail -22
echo "=== decode-families ($(date -u +%H:%M:%S))"
timeout 240 python3 -m loraplex.benchmarks decode-families --batch-sizes 1,16,64 --rank 16 --flora-rank 4 \
    --crossover-ranks 1,4,16 --prompt-len 256 --new-tokens 48 --out "$OUT" 2>&1 \
    | tee "$OUT/decode-families.log" | tail -60
cp "$OUT"/decode-families-*.json "$OUT"/flora-products-*.json bench/results/ 2>/dev/null || true
echo "=== done ($(date -u +%H:%M:%S))"

#!/usr/bin/env bash
# Tensor parallelism (issue 22) on a lent machine with two GPUs (nvidia-h100-x2 or
# nvidia-h200-x2), run from the repository root. Stages, in order, as named on the command line
# (default: all three):
#   tests   the two-GPU tests: TP=2 (NCCL, a worker process a GPU) against TP=1, float32 eager
#           token-exact and bf16 with CUDA graphs per rank
#   bench   loraplex bench tensor-parallel: Llama-3-8B shape, bf16, random weights, CUDA graphs
#           per rank: the batch-1 decode step at TP=2 against TP=1 (goal <= 0.6x), batch 64 with
#           64 rank-16 adapters (goal >= 1.7x the throughput), a step's collectives timed apart
#   eager   the same benchmark with every step eager (--enforce-eager): what the graphs buy
# NVLink multicast stays off (the workers set it again themselves). Logs and JSON go to $OUT
# (the device tool's folder that comes back), else bench/results/gpu-issue-22/; the JSON is
# also copied under bench/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu-issue-22}
mkdir -p "$OUT" bench/results
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -e loraplex/kernels ] || ln -sfn ../kernels loraplex/kernels
stages=${*:-tests bench eager}

for stage in $stages; do
    echo "=== $stage ($(date -u +%H:%M:%S))"
    case $stage in
        tests)
            nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader \
                | tee "$OUT/devices.txt"
            timeout 300 python3 -m pytest -q -s -m gpu -p no:cacheprovider --durations=5 \
                tests/parallel/test_engine_tp_gpu.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
            ;;
        bench)
            timeout 420 python3 -m loraplex.benchmarks tensor-parallel --out "$OUT" 2>&1 \
                | tee "$OUT/tensor-parallel.log" | tail -40
            ;;
        eager)
            mkdir -p "$OUT/eager"
            timeout 420 python3 -m loraplex.benchmarks tensor-parallel --enforce-eager --out "$OUT/eager" 2>&1 \
                | tee "$OUT/tensor-parallel-eager.log" | tail -40
            ;;
        *)
            echo "unknown stage $stage" >&2
            exit 2
            ;;
    esac
done
cp "$OUT"/tensor-parallel-*.json bench/results/ 2>/dev/null || true

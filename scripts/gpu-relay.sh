#!/usr/bin/env bash
# The relay kernel pass (first built for issue 12) on a lent GPU machine (torch 2.11, triton 3.6,
# nothing downloadable),
# run from the repository root; about 4 minutes a stage group. Stages, in order, as named on the
# command line (default: the first four; `engine` alone is its own ~4-minute command):
#   tests   the relay kernel's bf16 GPU tests, plus plain decode's and the CUDA-graph replays
#           (the plain path must be unchanged)
#   bench   loraplex bench relay-kernels: group size x prefix length x batch, and the crossover
#   plain   loraplex bench kernels for paged decode (the plain path's speed, to compare with
#           bench/results/kernels-h100-attention-tiles.json)
#   sweep   the prefix kernel's candidate launch configs at a few cases
#   engine  loraplex bench relay: 4 tenants' pinned 2,048/4,096-token prompts, batches 64-256,
#           relay decode vs prefix cache + plain decode vs no sharing, next to their floors;
#           and a request joining a warm prompt against a cold one
#   offline loraplex bench relay-offline: 1,024 prompts in 16 groups of unregistered 1,024-token
#           prefixes, 128 tokens each: global prefix grouping vs the prefix cache alone vs no
#           sharing (throughput, peak KV blocks)
#   gpu-engine the engine's GPU tests with relay decode in the CUDA graphs
# Logs and JSON go to $OUT (the device tool's folder that comes back), else
# bench/results/gpu-issue-12/; the JSON is also copied under bench/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu-issue-12}
mkdir -p "$OUT" bench/results
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
[ -e loraplex/kernels ] || ln -sfn ../kernels loraplex/kernels
stages=${*:-tests bench plain sweep}

for stage in $stages; do
    echo "=== $stage ($(date -u +%H:%M:%S))"
    case $stage in
        tests)
            nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
            timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 \
                tests/kernels/test_relay_attention_kernel.py tests/kernels/test_decode_attention_kernel.py \
                tests/kernels/test_graph_capture_kernel.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
            ;;
        bench)
            timeout 150 python3 -m loraplex.benchmarks relay-kernels --out "$OUT" 2>&1 \
                | tee "$OUT/relay-kernels.log" | tail -60
            ;;
        plain)
            timeout 60 python3 -m loraplex.benchmarks kernels --only bench_decode --tag issue-12-decode \
                --out "$OUT" 2>&1 | tee "$OUT/kernels-decode.log" | tail -12
            ;;
        sweep)
            timeout 90 python3 -m loraplex.benchmarks relay-kernels --sweep --out "$OUT" 2>&1 \
                | tee "$OUT/relay-kernels-sweep.log" | tail -40
            ;;
        engine)
            timeout 230 python3 -m loraplex.benchmarks relay --out "$OUT" 2>&1 \
                | tee "$OUT/relay-engine.log" | tail -40
            ;;
        offline)
            timeout 300 python3 -m loraplex.benchmarks relay-offline --out "$OUT" 2>&1 \
                | tee "$OUT/relay-offline.log" | tail -12
            ;;
        gpu-engine)
            timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_gpu_engine.py \
                tests/engine/test_relay_prefix.py 2>&1 | tee "$OUT/gpu-engine-tests.log" | tail -15
            ;;
        *)
            echo "unknown stage $stage" >&2
            exit 2
            ;;
    esac
done
cp "$OUT"/*.json bench/results/ 2>/dev/null || true

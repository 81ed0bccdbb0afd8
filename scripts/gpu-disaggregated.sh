#!/usr/bin/env bash
# Disaggregated prefill and decode (issue 23) on a lent machine with two GPUs (nvidia-h200-x2 or
# nvidia-h100-x2), run from the repository root in one device call. Stages, in order, as named
# on the command line (default: install tests bench):
#   install  the project, offline (scripts/gpu-pass.sh install)
#   tests    the two-GPU test: disaggregated 1:1 (prefill worker on GPU 0, decode worker on
#            GPU 1) against the colocated engine, float32 eager token-exact, bf16 with graphs
#   bench    loraplex bench disaggregated: Llama-3-8B shape, 1,000 rank-16 adapters, long-tailed
#            2K prompts, 256 out; 1:1 against two colocated replicas at each of RATES (req/s),
#            DURATION seconds of Poisson arrivals each; goodput within TTFT p90 <= 1 s and TPOT
#            p90 <= 50 ms, the KV transfers' bandwidth against a GPU-to-GPU copy's
#   ipc      studies/ipc_push_bandwidth.py: ways to copy into the other GPU's memory that another
#            process shares (about a minute)
#   adapters studies/adapter_load_workers.py: an adapter's load into a worker (one GPU)
# NVLink multicast stays off. Logs and JSON go to $OUT (the device tool's folder that comes back),
# else bench/results/gpu-issue-23/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu-issue-23}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
RATES=${RATES:-6,10,14,18}
DURATION=${DURATION:-12}
stages=${*:-install tests bench}

for stage in $stages; do
    echo "=== $stage ($(date -u +%H:%M:%S))"
    case $stage in
        install)
            timeout 150 scripts/gpu-pass.sh install > "$OUT/install.log" 2>&1 || echo "install failed"
            # the benchmark's synthetic adapters come from the serving benchmark, which needs the
            # server's packages: carry ./wheels (README, "The serving benchmark")
            [ -d wheels ] && timeout 120 python3 -m pip install -q --no-index --find-links wheels fastapi \
                fastapi-offline 'uvicorn[standard]' python-multipart sqlalchemy alembic prometheus-client httpx \
                tqdm >> "$OUT/install.log" 2>&1
            ;;
        tests)
            nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader \
                | tee "$OUT/devices.txt"
            nvidia-smi topo -m > "$OUT/topology.txt" 2>&1
            timeout 240 python3 -m pytest -q -s -m gpu -p no:cacheprovider --durations=5 \
                tests/parallel/test_engine_tp_gpu.py -k "disaggregated or peer" 2>&1 | tee "$OUT/gpu-tests.log" | tail -15
            ;;
        bench)
            timeout "${BENCH_TIMEOUT:-420}" python3 -m loraplex.benchmarks disaggregated --rates "$RATES" \
                --duration-s "$DURATION" --out "$OUT" ${BENCH_EXTRA:-} 2>&1 | tee "$OUT/disaggregated.log" | tail -30
            ;;
        ipc)
            timeout 180 python3 studies/ipc_push_bandwidth.py 2>&1 | tee "$OUT/ipc-push-bandwidth.log" | tail -5
            ;;
        adapters)
            timeout 180 python3 studies/adapter_load_workers.py 2>&1 | tee "$OUT/adapter-load-workers.log" | tail -5
            ;;
        *)
            echo "unknown stage $stage" >&2
            exit 2
            ;;
    esac
done

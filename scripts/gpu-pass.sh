#!/usr/bin/env bash
# A session's pass on a lent GPU machine, where nothing can be downloaded, run from the
# repository root with the stages named on the command line, in order:
#   install   the offline install (pip install --no-deps --no-build-isolation --no-index -e .),
#             then loraplex.kernels imported from another folder
#   tests     every GPU test (pytest -m gpu; with ./wheels carried, the server's packages first)
#   decode    loraplex bench decode: start-up, first batches, cold adapters, throughput
#   logprobs  loraplex bench prompt-logprobs: scoring prompts against plain prefill
#   kernels   loraplex bench kernels for attention (decode and prefill)
#   fairness  loraplex bench fairness: light tenants beside a flooding one, VTC + swapping vs FCFS
# Logs and results go to $OUT (the device tool's folder that comes back), else
# bench/results/gpu-pass/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu-pass}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

for stage in "$@"; do
    echo "=== $stage ($(date -u +%H:%M:%S))"
    case $stage in
        install)
            {
                nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
                python3 -c "import setuptools, torch, triton; print('setuptools', setuptools.__version__, \
'torch', torch.__version__, 'triton', triton.__version__)"
                time python3 -m pip install --no-deps --no-build-isolation --no-index -e .
                (cd /tmp && python3 -c "import loraplex.kernels as k; print('loraplex.kernels from', k.__file__)")
            } 2>&1 | tee "$OUT/install.log"
            ;;
        tests)
            # tests/engine imports the CLI, which needs the server's packages: carry ./wheels
            if [ -d wheels ]; then
                python3 -m pip install -q --no-index --find-links wheels fastapi fastapi-offline \
                    'uvicorn[standard]' python-multipart sqlalchemy alembic prometheus-client httpx tqdm \
                    > /dev/null 2>&1
            fi
            python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/engine 2>&1 \
                | tee "$OUT/gpu-tests.log" | tail -30
            ;;
        decode)
            python3 -m loraplex.benchmarks decode --out "$OUT" 2>&1 | tee "$OUT/decode.log" | tail -40
            ;;
        logprobs)
            python3 -m loraplex.benchmarks prompt-logprobs --out "$OUT" 2>&1 | tee "$OUT/prompt-logprobs.log" \
                | tail -20
            ;;
        kernels)
            python3 -m loraplex.benchmarks kernels --only "bench_decode|bench_prefill" --tag attention-tiles \
                --out "$OUT" 2>&1 | tee "$OUT/kernels.log" | tail -30
            ;;
        fairness)
            python3 -m loraplex.benchmarks fairness --out "$OUT" 2>&1 | tee "$OUT/fairness.log" | tail -30
            ;;
        *)
            echo "unknown stage $stage" >&2
            exit 2
            ;;
    esac
done

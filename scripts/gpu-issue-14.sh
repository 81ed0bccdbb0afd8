#!/usr/bin/env bash
# Issue 14's GPU pass, in one server start (about 7 minutes on an H100): the serving benchmark
# through HTTP on a Llama-3-8B-shaped model with random bf16 weights, 1,000 rank-16 adapters on
# all seven projections over 40 tenants, 32 device adapter slots.
#
#   scripts/gpu-issue-14.sh            (from the repository root; the lead runs it with carry: wheels)
#
# 1. installs the server's wheels from ./wheels (no network there; see the README's "Serving
#    benchmark" section for how the folder is made) and the project (scripts/gpu-pass.sh install);
# 2. starts loraplex.benchmarks.synthetic_server, which first runs the saturation workload
#    through the engine directly (offline) and then serves it over HTTP;
# 3. runs `loraplex bench serve` against it: the same workload at saturation over HTTP; Poisson
#    at 80% of that rate over 1,000 adapters (Zipf alpha 1.0) and over 32 (all resident); a
#    rate sweep for the highest rate at which p99 TTFT stays under 1 s, with 1,000 adapters and
#    with one;
# 4. sends SIGTERM (a drain: exit 0 expected) and writes serve-summary.json.
# Results go to $OUT (the device tool's folder) and are copied to bench/results/serve-h100/.
# SMOKE=1 runs the same steps on the CPU with a tiny model and few requests (a check of the
# script itself: about 6 minutes on two cores; nothing is copied to bench/results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/serve-h100}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PORT=${PORT:-8300}
WORK=$(mktemp -d)
start=$(date +%s)
stamp() { echo "=== $* ($(( $(date +%s) - start )) s)"; }

SERVER_OPTS=(--max-loras 32 --max-num-seqs 128 --max-num-batched-tokens 8192 --max-model-len 4096)
N_SAT=600; N_RATE=250
if [ "${SMOKE:-0}" = 1 ]; then
    SERVER_OPTS=(--device cpu --max-loras 8 --max-num-seqs 32 --max-num-batched-tokens 2048 --max-model-len 2048
                 --model-overrides '{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}')
    N_SAT=60; N_RATE=30
fi

stamp install
if [ "${SMOKE:-0}" != 1 ]; then
python3 -m pip install -q --no-index --find-links wheels fastapi fastapi-offline 'uvicorn[standard]' \
    python-multipart sqlalchemy alembic prometheus-client httpx tqdm 2>&1 | tail -5 | tee "$OUT/install.log"
scripts/gpu-pass.sh install > /dev/null 2>&1 || echo "project install failed (see gpu-pass)" | tee -a "$OUT/install.log"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/install.log"
fi

# The saturation workload: every request at once; the offline pass runs the very same list.
COMMON=(--num-tenants 40 --prompt-len 256 --prompt-dist longtail --max-prompt-len 1024 --output-len 128
        --zipf-alpha 1.0 --seed 14)
SAT_JSON='{"num_prompts": '$N_SAT', "num_tenants": 40, "num_adapters": 1000, "prompt_len": 256,
  "prompt_dist": "longtail", "max_prompt_len": 1024, "output_len": 128, "zipf_alpha": 1.0, "seed": 14}'

stamp "server start (engine build + offline pass)"
python3 -m loraplex.benchmarks.synthetic_server --port "$PORT" --setup "$WORK/setup.json" \
    --num-adapters 1000 --num-tenants 40 --rank 16 "${SERVER_OPTS[@]}" --offline "$SAT_JSON" --out "$OUT" \
    > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 300); do
    if python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/ready', timeout=1)" \
        > /dev/null 2>&1; then break; fi
    if ! kill -0 $SERVER 2>/dev/null; then echo "server died"; tail -30 "$OUT/server.log"; exit 1; fi
    sleep 1
done
tail -3 "$OUT/server.log"

bench() {  # TAG [options...]
    local tag=$1; shift
    stamp "bench $tag"
    timeout 150 python3 -m loraplex.benchmarks serve --setup "$WORK/setup.json" --tag "$tag" --out "$OUT" \
        --no-plot "${COMMON[@]}" "$@" 2>>"$OUT/bench-progress.log" | tee "$OUT/serve-$tag.log" \
        | grep -E '"(completed|failed|request_throughput|output_throughput|p99|server_cpu_ms_per_token)"' \
        | tr -d '\n '; echo
}
rate_of() { python3 -c "import json,sys; print(json.load(open('$OUT/serve-$1.json'))['request_throughput'])"; }

bench saturation-1000 --num-prompts $N_SAT --num-adapters 1000
SAT=$(rate_of saturation-1000)
RATE=$(python3 -c "print(round(0.8 * $SAT, 2))")
echo "saturated: $SAT req/s; Poisson at $RATE req/s"
bench poisson-1000 --num-prompts $N_SAT --num-adapters 1000 --request-rate "$RATE"
bench poisson-32 --num-prompts $N_SAT --num-adapters 32 --request-rate "$RATE"
for fraction in 0.7 0.9 1.0 1.1 1.25; do
    r=$(python3 -c "print(round($fraction * $SAT, 2))")
    bench "rate-1000-$fraction" --num-prompts $N_RATE --num-adapters 1000 --request-rate "$r"
    bench "rate-1-$fraction" --num-prompts $N_RATE --num-adapters 1 --request-rate "$r"
done

stamp "drain (SIGTERM)"
kill -TERM $SERVER
wait $SERVER
echo "server exit code $?" | tee -a "$OUT/server.log"
python3 -m loraplex.benchmarks.serve_report "$OUT" | tee "$OUT/summary.log"
if [ "${SMOKE:-0}" != 1 ] && [ "$OUT" != bench/results/serve-h100 ]; then mkdir -p bench/results/serve-h100 && cp "$OUT"/* bench/results/serve-h100/; fi
stamp done

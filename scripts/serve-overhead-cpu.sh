#!/usr/bin/env bash
# The HTTP server's own cost per generated token, measured on the CPU: the same requests through
# the engine directly (synthetic_server's offline pass) and through HTTP at saturation
# (`loraplex bench serve`, every request at once, streaming), on a tiny model whose step is cheap
# enough that what the server adds per token shows. Eight adapters, all resident; 128 running
# requests at most, as on the H100.
#
#   scripts/serve-overhead-cpu.sh LABEL [REPEATS]      (from the repository root)
#
# Each of REPEATS server starts runs the offline pass and then one HTTP run, so that each pair ran
# close in time (on a shared machine the load moves). Records under LABEL in
# bench/results/serve-overhead-cpu.json: each HTTP run against its offline
# pass (output tok/s both ways, CPU ms per generated token of the server process and of its
# engine thread, event loop and other threads) and their medians; the output goes to the .log
# beside it too. The machine runs the client as well: the figures that matter are the server's
# CPU per token (the client's is not in them) and HTTP against offline on the same machine.
# SERVER_OPTIONS: more synthetic_server options (e.g. --switch-interval-ms 0.5).
# Torch runs one intra-op thread (OMP_NUM_THREADS=1 unless set): the engine thread alone drives
# the model, as on the GPU, and torch's spinning workers do not take the event loop's core.
set -euo pipefail
cd "$(dirname "$0")/.."
LABEL=${1:?label}
REPEATS=${2:-3}
PORT=${PORT:-8321}
PYTHON=${PYTHON:-python3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
RESULT=bench/results/serve-overhead-cpu.json
WORK=$(mktemp -d)
WORKLOAD=(--num-prompts 256 --num-tenants 8 --num-adapters 8 --prompt-len 64 --output-len 128 --seed 14)
OFFLINE='{"num_prompts": 256, "num_tenants": 8, "num_adapters": 8, "prompt_len": 64, "output_len": 128,
  "seed": 14}'

exec > >(tee -a "${RESULT%.json}.log") 2>&1
echo "=== $LABEL: $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg), OMP_NUM_THREADS=$OMP_NUM_THREADS"
for i in $(seq "$REPEATS"); do  # a server start each: its offline pass, then one HTTP run
    PAIR=$WORK/pair-$i
    mkdir -p "$PAIR"
    $PYTHON -m loraplex.benchmarks.synthetic_server --port "$PORT" --setup "$PAIR/setup.json" --device cpu \
        --num-adapters 8 --num-tenants 8 --rank 16 --max-loras 8 --max-num-seqs 128 \
        --max-num-batched-tokens 2048 --max-model-len 2048 --model-overrides '{"hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1000}' --offline "$OFFLINE" --out "$PAIR" --shutdown-timeout 10 ${SERVER_OPTIONS:-} \
        > "$PAIR/server.log" 2>&1 &
    SERVER=$!
    trap 'kill $SERVER 2>/dev/null || true' EXIT
    until [ -f "$PAIR/setup.json" ] && $PYTHON -c "import urllib.request as u
u.urlopen('http://127.0.0.1:$PORT/ready', timeout=1)" > /dev/null 2>&1; do
        kill -0 $SERVER 2>/dev/null || { tail -20 "$PAIR/server.log"; exit 1; }
        sleep 1
    done
    grep '"serve-offline"' "$PAIR/server.log" | $PYTHON -c "import json,sys; r=json.load(sys.stdin)
print('offline:', r['output_throughput'], 'tok/s,', r['engine_cpu_ms_per_token'], 'ms CPU/token; ', end='')"
    $PYTHON -m loraplex.benchmarks serve --setup "$PAIR/setup.json" --tag overhead --out "$PAIR" --no-plot \
        "${WORKLOAD[@]}" 2>/dev/null | grep -E '"(failed|output_throughput|[a-z_]+_ms_per_token)"' | tr -d '\n '
    echo
    kill -TERM $SERVER
    wait $SERVER || true
done
$PYTHON -m loraplex.benchmarks.serve_report "$WORK" --record-overhead "$RESULT" --label "$LABEL" \
    | $PYTHON -c "import json,sys; print('median:', json.dumps(json.load(sys.stdin)['median']))"
rm -rf "$WORK"

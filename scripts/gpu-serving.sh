#!/usr/bin/env bash
# The serving benchmark's GPU pass (first built for issue 14), in one server start, within one
# 600 s device command: the serving benchmark through HTTP on a Llama-3-8B-shaped model with random bf16 weights, 1,000 rank-16
# adapters on all seven projections over 40 tenants, at most MAX_LORAS adapters resident (default
# 32, issue 14's runs; MAX_LORAS= sets no cap: as many as the device pool holds, issue 27).
# RANKS=8,16,64 mixes ranks instead of rank 16 alone (synthetic_server --ranks: of n ranks, adapter j
# has the (j mod n)-th, equal shares, each rank its own random adapters; max_lora_rank the largest).
#
#   scripts/gpu-serving.sh            (from the repository root; the lead runs it with carry: wheels)
#   MAX_LORAS= scripts/gpu-serving.sh (no --max-loras)
#   RANKS=8,16,64 MAX_LORAS= scripts/gpu-serving.sh (mixed ranks, no cap)
#
# 1. installs the server's wheels from ./wheels (no network there; see the README's "Serving
#    benchmark" section for how the folder is made) and the project (scripts/gpu-pass.sh install);
# 2. starts loraplex.benchmarks.synthetic_server, which first runs the saturation workload
#    through the engine directly (offline) and then serves it over HTTP;
# 3. runs `loraplex bench serve` against it: the same workload at saturation over HTTP (with the
#    offline pass: HTTP against offline, the server's CPU per token); Poisson at 80% of that rate
#    over 1,000 adapters (Zipf alpha 1.0) and over 32 (all resident: throughput, TTFT and the
#    cold loads' effect on ITL); a rate sweep for the highest rate at which p99 TTFT stays under
#    1 s, with 1,000 adapters and with one, the two interleaved; before the sweep, issue 27's
#    terms: 80% of the one-adapter saturated rate, 1,000 adapters against one adapter there and
#    against the same 1,000-adapter run again (serve-summary.json's issue_27);
# 4. sends SIGTERM (a drain: exit 0 expected) and writes serve-summary.json; its
#    device_bytes_by_rank states, by rank, the adapters resident after the drain, their mean device
#    bytes and the bytes per rank unit (the same for every rank when bytes are proportional to rank;
#    the figures after the offline pass if the server did not drain).
# Every run starts with the server's prefix cache reset (`--reset-prefix-cache`): runs that send a
# workload again (saturation after the offline pass, issue 27's "again") compute their prompts as
# the first did, and differ from it only in what they are measured for (adapters loaded before).
# The whole pass has BUDGET seconds (510, install included): every stage gets a time limit from
# what is left (a bench run past its limit drops its unfinished requests as failures and still
# writes its JSON), stages that no longer fit are skipped, and serve-summary.json is rewritten
# after every run, so whatever happens $OUT holds every figure measured so far, the most
# important first. The device tool brings back only a few files, so $OUT holds three:
# install.log, serve-summary.json and serve-h100.tar.gz (every run's JSON and log, the server's
# log; unpack into bench/results/serve-h100/). Run elsewhere, the runs are also copied there.
# SMOKE=1 runs the same steps on the CPU with a tiny model and few requests (a check of the
# script itself, under the same budget; nothing is copied to bench/results). SWITCH_INTERVAL_MS
# sets the server's sys.setswitchinterval (default Python's 5 ms: how long the engine thread
# may wait for the GIL while the event loop holds it); serve-summary.json's http_vs_offline
# splits the server's CPU per token between the engine thread, the event loop and the rest.
# SERVER_EXTRA adds synthetic_server flags (e.g. "--hold-places-for-loading --fairness-bound 16384
# --max-num-seqs 256": a later flag wins). On a GPU the engine runs in a process of its own, as
# `loraplex serve`'s does there (the engine-core process: the offline pass, the step log and the
# device bytes after it come from that process); SERVER_EXTRA=--no-engine-process runs it on a
# thread of the server's process instead (runs 1-6 of bench/results/serve-h200-2026-11-28/).
# PYSPY=1 samples the server's threads with py-spy (its wheel carried in ./wheels: pip download
# py-spy) during the runs named in PYSPY_RUNS (default "poisson-1000"; e.g. "issue-1
# issue-1000-again"), 30 s at most each: pyspy-<run>-threads.txt (every thread, idle included) and
# -gil.txt (only the thread holding the GIL), collapsed stacks, in the tarball; the engine-core
# process is sampled with the server (--subprocesses; its stacks carry its pid).
# STEP_LOG=1 has the server note every step in steps.csv (synthetic_server --step-log) and each
# step's own device time in steps-device.csv, both in the tarball.
# MIXED_GRAPHS=0 runs steps with prompt tokens eagerly (EngineConfig.mixed_step_graphs off; on by
# default); DELAY_FACTOR sets SchedulerConfig.scheduler_delay_factor (default 1.0; it applies
# only with MIXED_GRAPHS=0).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/serve-h100}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PORT=${PORT:-8300}
BUDGET=${BUDGET:-510}
WORK=$(mktemp -d)
RES=$WORK/serve-h100
mkdir -p "$RES"
start=$(date +%s)
stamp() { echo "=== $* ($(( $(date +%s) - start )) s)"; }
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
RESERVE=25  # drain and the summary at the end

MAX_LORAS=${MAX_LORAS-32}
RANKS=${RANKS:-}
SERVER_OPTS=(${MAX_LORAS:+--max-loras "$MAX_LORAS"} --max-num-seqs 128 --max-num-batched-tokens 8192 --max-model-len 4096)
N_SAT=600; N_RATE=250; START_LIMIT=180; SAT_LIMIT=60; POISSON_LIMIT=60; RATE_LIMIT=35
if [ "${SMOKE:-0}" = 1 ]; then
    SERVER_OPTS=(--device cpu ${MAX_LORAS:+--max-loras 8} --max-num-seqs 32 --max-num-batched-tokens 2048 --max-model-len 2048
                 --model-overrides '{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}')
    N_SAT=60; N_RATE=30
fi
if [ -n "${SWITCH_INTERVAL_MS:-}" ]; then SERVER_OPTS+=(--switch-interval-ms "$SWITCH_INTERVAL_MS"); fi
if [ "${MIXED_GRAPHS:-1}" = 0 ]; then SERVER_OPTS+=(--no-mixed-step-graphs); fi
if [ -n "${DELAY_FACTOR:-}" ]; then SERVER_OPTS+=(--scheduler-delay-factor "$DELAY_FACTOR"); fi
PYSPY=${PYSPY:-0}
PYSPY_RUNS=${PYSPY_RUNS:-poisson-1000}
if [ "${STEP_LOG:-0}" = 1 ]; then SERVER_OPTS+=(--step-log "$RES/steps.csv"); fi
read -r -a EXTRA <<< "${SERVER_EXTRA:-}"
SERVER_OPTS+=(${EXTRA[@]+"${EXTRA[@]}"})

publish() {  # the summary so far, and every run's files, into $OUT
    python3 -m loraplex.benchmarks.serve_report "$RES" > "$RES/summary.log" 2>&1
    cp "$RES/serve-summary.json" "$OUT/" 2>/dev/null
    tar czf "$OUT/serve-h100.tar.gz.part" -C "$WORK" serve-h100 && mv "$OUT/serve-h100.tar.gz.part" "$OUT/serve-h100.tar.gz"
}

stamp install
if [ "${SMOKE:-0}" != 1 ]; then
timeout 90 python3 -m pip install -q --no-index --find-links wheels fastapi fastapi-offline 'uvicorn[standard]' \
    python-multipart sqlalchemy alembic prometheus-client httpx tqdm 2>&1 | tail -5 | tee "$OUT/install.log"
timeout 90 scripts/gpu-pass.sh install > /dev/null 2>&1 || echo "project install failed (see gpu-pass)" | tee -a "$OUT/install.log"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/install.log"
fi
if [ "$PYSPY" = 1 ]; then python3 -m pip install -q --no-index --find-links wheels py-spy > /dev/null 2>&1; fi

# The saturation workload: every request at once; the offline pass runs the very same list.
COMMON=(--num-tenants 40 --prompt-len 256 --prompt-dist longtail --max-prompt-len 1024 --output-len 128
        --zipf-alpha 1.0 --seed 14)
SAT_JSON='{"num_prompts": '$N_SAT', "num_tenants": 40, "num_adapters": 1000, "prompt_len": 256,
  "prompt_dist": "longtail", "max_prompt_len": 1024, "output_len": 128, "zipf_alpha": 1.0, "seed": 14}'

stamp "server start (engine build + offline pass)"
python3 -m loraplex.benchmarks.synthetic_server --port "$PORT" --setup "$WORK/setup.json" \
    --num-adapters 1000 --num-tenants 40 --rank 16 ${RANKS:+--ranks "$RANKS"} "${SERVER_OPTS[@]}" \
    --offline "$SAT_JSON" --out "$RES" --shutdown-timeout 15 > "$RES/server.log" 2>&1 &
SERVER=$!
ready_by=$(( $(date +%s) + START_LIMIT ))
until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/ready', timeout=1)" \
        > /dev/null 2>&1; do
    if ! kill -0 $SERVER 2>/dev/null; then echo "server died"; tail -30 "$RES/server.log"; publish; exit 1; fi
    if [ "$(date +%s)" -ge "$ready_by" ]; then
        echo "server not ready within $START_LIMIT s"; tail -30 "$RES/server.log"; kill -KILL $SERVER; publish; exit 1
    fi
    sleep 1
done
tail -3 "$RES/server.log"

bench() {  # TAG CAP_S [options...]: one run, limited to CAP_S and to what the budget has left
    local tag=$1 cap=$2; shift 2
    local limit=$(( $(left) - RESERVE ))
    [ "$limit" -gt "$cap" ] && limit=$cap
    if [ "$limit" -lt 10 ]; then stamp "skip $tag (budget spent)"; return 1; fi
    stamp "bench $tag (limit $limit s)"
    echo "$tag $(date +%s.%N)" >> "$RES/run-starts.log"  # Unix time, beside the step log's
    local spies=()
    if [ "$PYSPY" = 1 ] && [[ " $PYSPY_RUNS " == *" $tag "* ]]; then  # where the server's threads spend it
        for mode in threads gil; do
            local flags=(--threads --idle); [ $mode = gil ] && flags=(--threads --gil)
            timeout 70 py-spy record --pid $SERVER --subprocesses --rate 50 --duration $(( limit < 30 ? limit : 30 )) \
                --nonblocking --format raw "${flags[@]}" -o "$RES/pyspy-$tag-$mode.txt" \
                > "$RES/pyspy-$tag-$mode.log" 2>&1 &
            spies+=($!)
        done
    fi
    timeout $(( limit + 20 )) python3 -m loraplex.benchmarks serve --setup "$WORK/setup.json" --tag "$tag" \
        --out "$RES" --no-plot --time-limit "$limit" --reset-prefix-cache "${COMMON[@]}" "$@" \
        2>>"$RES/bench-progress.log" \
        | tee "$RES/serve-$tag.log" \
        | grep -E '"(completed|failed|request_throughput|output_throughput|p99|server_cpu_ms_per_token)"' \
        | tr -d '\n '; echo
    for spy in ${spies[@]+"${spies[@]}"}; do wait "$spy"; done
    publish
}
rate_of() { python3 -c "import json,sys; print(json.load(open('$RES/serve-$1.json'))['request_throughput'])"; }

if bench saturation-1000 $SAT_LIMIT --num-prompts $N_SAT --num-adapters 1000 && [ -f "$RES/serve-saturation-1000.json" ]; then
    SAT=$(rate_of saturation-1000)
    RATE=$(python3 -c "print(round(0.8 * $SAT, 2))")
    echo "saturated: $SAT req/s; Poisson at $RATE req/s"
    bench poisson-1000 $POISSON_LIMIT --num-prompts $N_SAT --num-adapters 1000 --request-rate "$RATE"
    bench poisson-32 $POISSON_LIMIT --num-prompts $N_SAT --num-adapters 32 --request-rate "$RATE"
    # Issue 27's own terms: 80% of the ONE-adapter saturated rate; 1,000 adapters (new draws: seed
    # 27) against one adapter at that rate, then the same 1,000-adapter run again (its adapters
    # loaded by the first); serve-summary.json's issue_27
    if bench saturation-1 $SAT_LIMIT --num-prompts $N_SAT --num-adapters 1 && [ -f "$RES/serve-saturation-1.json" ]; then
        RATE1=$(python3 -c "print(round(0.8 * $(rate_of saturation-1), 2))")
        echo "issue 27's runs at $RATE1 req/s"
        for run in 1:1 1000:1000 1000-again:1000; do
            python3 -c "import sys; sys.exit($RATE1 <= 0)" || break  # (no request finished in the limit)
            bench "issue-${run%%:*}" $POISSON_LIMIT --num-prompts $N_SAT --num-adapters "${run##*:}" \
                --request-rate "$RATE1" --seed 27
        done
    fi
    for fraction in 0.7 0.9 1.1 1.0 1.25; do  # coarse first; serve_report sorts them
        r=$(python3 -c "print(round($fraction * $SAT, 2))")
        bench "rate-1000-$fraction" $RATE_LIMIT --num-prompts $N_RATE --num-adapters 1000 --request-rate "$r"
        bench "rate-1-$fraction" $RATE_LIMIT --num-prompts $N_RATE --num-adapters 1 --request-rate "$r"
    done
fi

stamp "drain (SIGTERM)"
kill -TERM $SERVER
for _ in $(seq 20); do kill -0 $SERVER 2>/dev/null || break; sleep 1; done
if kill -0 $SERVER 2>/dev/null; then echo "server still running after 20 s: killed"; kill -KILL $SERVER; fi
wait $SERVER
echo "server exit code $?" | tee -a "$RES/server.log"
publish; cat "$OUT/serve-summary.json"
if [ "${SMOKE:-0}" != 1 ]; then mkdir -p bench/results/serve-h100 && cp "$RES"/* bench/results/serve-h100/; fi
stamp done

#!/usr/bin/env bash
# The fairness benchmark's GPU pass (issue 29, the fairness regression), stages named on the
# command line, in order:
#   install          scripts/gpu-pass.sh install
#   fairness         loraplex bench fairness at this tree (alone, FCFS, VTC)
#   system-prompts   the same with each tenant's registered 256-token system prompt pinned
#   seed:N           the benchmark (alone, FCFS, VTC) with arrivals drawn from seed N
#   variant:NAME:RUNS  the benchmark's RUNS (e.g. alone,vtc) with the loraplex package of
#                    .device/NAME/ first on the path (a copy of this tree with one change
#                    undone or tried; made here, carried to the device, never committed)
# Set LORAPLEX_COMMIT to the commit that the results should record (the device has no git), and
# FAIRNESS_ARGS to flags that every stage's benchmark takes (e.g. "--max-num-batched-tokens 1536
# --fairness-kv-headroom 0.15625", the fairness simulation's recommendation).
# JSON and logs go to $OUT (default bench/results/gpu-issue-29).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu-issue-29}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
COMMIT=${LORAPLEX_COMMIT:-unknown}
read -r -a ARGS <<< "${FAIRNESS_ARGS:-}"

for stage in "$@"; do
    echo "=== $stage ($(date -u +%H:%M:%S))"
    case $stage in
        install)
            scripts/gpu-pass.sh install > /dev/null 2>&1 && echo installed || { echo "install failed"; exit 1; }
            ;;
        fairness)
            python3 -m loraplex.benchmarks fairness "${ARGS[@]}" --out "$OUT" 2>&1 | tee "$OUT/fairness.log" | tail -8
            ;;
        system-prompts)
            python3 -m loraplex.benchmarks fairness "${ARGS[@]}" --system-prompt-len 256 --out "$OUT" 2>&1 \
                | tee "$OUT/fairness-system-prompts.log" | tail -8
            ;;
        seed:*)
            seed=${stage#seed:}
            mkdir -p "$OUT/seed-$seed"
            python3 -m loraplex.benchmarks fairness "${ARGS[@]}" --seed "$seed" --out "$OUT/seed-$seed" 2>&1 \
                | tee "$OUT/seed-$seed/fairness.log" | tail -8
            ;;
        variant:*)
            IFS=: read -r _ name runs <<< "$stage"
            mkdir -p "$OUT/$name"
            # -P: `python -m` puts the working directory (this tree) before PYTHONPATH on the
            # path, which ran this tree's package instead of the variant's until 2a1c05f
            LORAPLEX_COMMIT="$COMMIT+$name" PYTHONPATH=".device/$name" \
                python3 -P -m loraplex.benchmarks fairness "${ARGS[@]}" --runs "$runs" --out "$OUT/$name" 2>&1 \
                | tee "$OUT/$name/fairness.log" | tail -8
            ;;
        *)
            echo "unknown stage $stage" >&2
            exit 2
            ;;
    esac
done

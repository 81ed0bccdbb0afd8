#!/usr/bin/env bash
# The GPU regression pass in one device command (at most 600 s): the offline install, then
# `loraplex bench regression` (loraplex/benchmarks/regression.py): decode, fairness, adapter
# families, relay and serving at reduced size within BUDGET seconds (default 540, install
# excluded; less if the install took more than 20 s, so that the command ends within
# LIMIT=580 s), each figure against the one recorded for this device in bench/results/.
#
#   COMMIT=<sha> scripts/gpu-regress.sh      (from the repository root; carry: ["wheels"])
#
# COMMIT names the code in the JSON (the device's copy of the tree has no .git; without it the
# JSON still holds a sha256 of the sources). ./wheels (the server's wheels: README, "The serving
# benchmark") lets the serving stage run; without it that stage is skipped and says so.
# $OUT (else bench/results/gpu-regress/) receives four files: install.log, regression.log (the
# stages' progress and the table), regression-<device>.json (every figure, its record and
# verdict, the commit and device; commit it to bench/results/ as the next passes' record once
# its figures are accepted) and regression-stages.tar.gz (each stage's own JSON and log).
# Exit status: the pass's (1 when a figure moved beyond its tolerance, missed its goal, or a
# stage failed or ran out of time).
#
# SMOKE=1 runs the pass on the CPU with a tiny model instead (no install; about 30 s here):
#   SMOKE=1 OUT=/tmp/regress scripts/gpu-regress.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu-regress}
mkdir -p "$OUT"
export OUT
export PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-540}
LIMIT=${LIMIT:-580}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)

if [ "${SMOKE:-0}" = 1 ]; then
    python3 -m loraplex.benchmarks regression --smoke --out "$OUT" --work "$WORK" --budget-s "$BUDGET" \
        ${COMMIT:+--commit "$COMMIT"} 2>&1 | tee "$OUT/regression.log"
    status=${PIPESTATUS[0]}
    tar czf "$OUT/regression-stages.tar.gz" --exclude='*.png' -C "$WORK" .
    exit "$status"
fi

echo "=== install ($(date -u +%H:%M:%S))"
if [ -d wheels ]; then
    timeout 120 python3 -m pip install -q --no-index --find-links wheels fastapi fastapi-offline \
        'uvicorn[standard]' python-multipart sqlalchemy alembic prometheus-client httpx tqdm 2>&1 \
        | tail -5 > "$WORK/wheels.log"
fi
timeout 120 scripts/gpu-pass.sh install > /dev/null 2>&1 || echo "project install failed" >> "$OUT/install.log"
cat "$WORK/wheels.log" >> "$OUT/install.log" 2>/dev/null
echo "install took $(( $(date +%s) - start )) s" | tee -a "$OUT/install.log"

# The pass gets BUDGET, or less where the install took long: the command ends by LIMIT seconds
# (the device call's 600, less the device probe, the table and the archive).
left=$(( LIMIT - ($(date +%s) - start) - 20 ))
[ "$left" -lt "$BUDGET" ] && BUDGET=$left
echo "=== regression pass, budget $BUDGET s ($(date -u +%H:%M:%S))"
python3 -m loraplex.benchmarks regression --out "$OUT" --work "$WORK" --budget-s "$BUDGET" \
    ${COMMIT:+--commit "$COMMIT"} 2>&1 | tee "$OUT/regression.log"
status=${PIPESTATUS[0]}
tar czf "$OUT/regression-stages.tar.gz" --exclude='*.png' -C "$WORK" .
echo "=== done in $(( $(date +%s) - start )) s, exit status $status"
exit "$status"

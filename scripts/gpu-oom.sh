#!/usr/bin/env bash
# Issue 26, fault 3 on a GPU, in one device command (a few minutes; at most 600 s): the project's
# offline install, then the out-of-memory tests on CUDA. test_gpu_out_of_memory_check allocates
# all of the device's free memory but 64 MiB away (a tensor that stands for another process or a
# leak) while three small requests decode, and sends a 1,000-token prompt whose step needs more:
# torch.OutOfMemoryError from the caching allocator; the prompt fails with
# out_of_device_memory, the small requests finish with the tokens they give without the fault,
# every KV block, slot and runner row comes back, and the prompt is served once the memory is
# freed (sync and async scheduling). The CPU variant (RLIMIT_DATA) runs too, as a reference.
#
#   scripts/gpu-oom.sh      (from the repository root; writes under $OUT, else /tmp/gpu-oom)
#
# $OUT receives install.log and oom.log (pytest's output, -s: the error each failed request got).
# Exit status: pytest's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-oom}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
timeout 180 scripts/gpu-pass.sh install > /dev/null 2>&1 || echo "project install failed" >> "$OUT/install.log"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee -a "$OUT/install.log"
timeout 360 python3 -m pytest -p no:cacheprovider -s -v -rs \
    tests/engine/test_out_of_memory.py 2>&1 | tee "$OUT/oom.log"
exit "${PIPESTATUS[0]}"

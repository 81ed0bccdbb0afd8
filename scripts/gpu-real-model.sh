#!/usr/bin/env bash
# The real model's GPU figures (SmolLM2-135M-Instruct with the quick start's three trained
# adapters; issue 21), stages named on the command line, in order:
#   stash      keep .device/gguf-a (the GGUF file's first half) and .device/real-model (the
#              adapters, the `gguf` wheel, the file's digest) where the next call finds them
#   install    the project (scripts/gpu-pass.sh install) and the `gguf` wheel
#   import     join .device/gguf-a and gguf-b, check its digest, `loraplex model import` it
#   accuracy   bf16 greedy agreement with float32, teacher-forced, 64 prompts x 128 tokens,
#              none/pirate/extract/sentiment in turn, beside transformers + PEFT in bf16
#   decode     decode throughput at batch 1, 64 and 256, without and with adapters (random,
#              rank 16, one per request), beside transformers and transformers + PEFT
#   blending   issue 25: 50 questions over 4 registered documents of 1,024 tokens, answers blended
#              at shares 0 to 1 against full prefill (float32), and time to first token at 4K
#              prompt tokens on a Llama-3-8B shape (bf16), full prefill against a blend
# The GGUF file (98 MB) is larger than one device call may carry, so it goes in two calls on one
# warm machine: `stash` carrying .device/gguf-a and .device/real-model, then the rest carrying
# .device/gguf-b (all made by `scripts/gpu-real-model.sh prepare` here, never committed).
# Set LORAPLEX_COMMIT to the commit that the results should record (the device has no git).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/real-model}
STASH=${STASH:-/tmp/loraplex-real-model}
CARRY=$STASH/real-model
MODEL="$STASH/SmolLM2-135M-Instruct"
export PYTHONUNBUFFERED=1

for stage in "$@"; do
    echo "=== $stage ($(date -u +%H:%M:%S))"
    case $stage in
        prepare)  # here, not on the device: the carried files from the installed package and quick
            # start (its adapters, for accuracy; without QUICKSTART_DATA none: enough for blending)
            gguf=$(python3 -c "from loraplex.quickstart.assets import SMOLLM2; from loraplex.quickstart.source import installed_gguf; print(installed_gguf(SMOLLM2))")
            CARRY=.device/real-model
            rm -rf "$CARRY" .device/gguf-a .device/gguf-b && mkdir -p "$CARRY/wheels"
            size=$(stat -c %s "$gguf")
            head -c $((size / 2)) "$gguf" > .device/gguf-a
            tail -c +$((size / 2 + 1)) "$gguf" > .device/gguf-b
            sha256sum < "$gguf" | cut -d' ' -f1 > "$CARRY/gguf.sha256"
            if [ -n "${QUICKSTART_DATA:-}" ]; then
                cp -r "$QUICKSTART_DATA/quickstart/adapters" "$CARRY/adapters"
            else
                echo "QUICKSTART_DATA is not set: no adapters carried (the accuracy stage needs them)"
            fi
            pip download -q --no-deps -d "$CARRY/wheels" gguf
            du -sh .device/gguf-a .device/gguf-b "$CARRY"
            ;;
        stash)
            rm -rf "$STASH" && mkdir -p "$STASH" && cp .device/gguf-a "$STASH/gguf-a" \
                && cp -r .device/real-model "$CARRY" && du -sh "$STASH"/*
            ;;
        install)
            scripts/gpu-pass.sh install > /dev/null 2>&1 && echo installed || { echo "install failed"; exit 1; }
            python3 -m pip install -q --no-deps --no-index --find-links "$CARRY/wheels" gguf || exit 1
            ;;
        import)
            cat "$STASH/gguf-a" .device/gguf-b > "$STASH/model.gguf"
            [ "$(sha256sum < "$STASH/model.gguf" | cut -d' ' -f1)" = "$(cat "$CARRY/gguf.sha256")" ] \
                || { echo "the joined GGUF file's digest differs from the package's"; exit 1; }
            python3 -c "
from pathlib import Path
from loraplex.model.gguf_import import import_gguf
import_gguf(Path('$STASH/model.gguf'), Path('$MODEL'), show_progress=False)
print('imported into $MODEL')" || exit 1
            ;;
        accuracy)
            mkdir -p "$OUT"
            python3 -m loraplex.benchmarks accuracy --model "$MODEL" --num-requests 64 --new-tokens 128 \
                --adapter pirate="$CARRY/adapters/pirate" --adapter extract="$CARRY/adapters/extract" \
                --adapter sentiment="$CARRY/adapters/sentiment" --out "$OUT" 2>&1 \
                | tee "$OUT/accuracy.log" | grep -v "^ \{6,\}" | tail -40
            ;;
        decode)
            mkdir -p "$OUT"
            python3 -m loraplex.benchmarks decode --model "$MODEL" --batch-sizes 1,64,256 \
                --hf-batch-sizes 1,64,256 --out "$OUT" 2>&1 | tee "$OUT/decode.log" | tail -16
            ;;
        blending)
            mkdir -p "$OUT"
            python3 -m loraplex.benchmarks blending --model "$MODEL" --shares 0,0.2,0.5,0.8,0.9,1 --out "$OUT" 2>&1 \
                | tee "$OUT/blending.log" | grep -v "^question" | tail -30
            ;;
        *)
            echo "unknown stage $stage" >&2
            exit 2
            ;;
    esac
done

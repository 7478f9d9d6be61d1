#!/usr/bin/env bash
# The fifteenth session's hamlet plans with the first position kept exact (docs/beyond-q8.md): the
# tenth session's spread sensitivities (measured without a kept sink) reused, the budget q8's KLD on
# the held-out chunks with nothing kept, the three calibration targets fixed before the tenth
# session's runs. First run as a Python script that set the lab's keep_sink by hand; `lab plan
# --keep-sink` (a later commit) gives the same recipe files and KLDs (checked for each T).
# Sixteenth session: `plan_sink.sh docs/beyond-q8/q4search/hamlet-sink-store` reran it unchanged once
# the engine's sink store had landed (the f16 sink row in every probe, check and verification, and
# "keep_sink": 1 in the recipe files), writing there instead of here.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
D=docs/beyond-q8/q4search
OUT=${1:-$D/hamlet-sink}
for T in 0.8 0.9 1.0; do
  .venv/bin/kvlens lab plan --model smollm2 --corpus hamlet_gut --kld-budget 0.000858 --calib-target $T \
    --calib-chunks 4 --calib-spread --ctx 256 --heldout-chunks 8 --prefill-chunk 32 --kv q8 \
    --candidates q8h,q7h,q6h,q5h,q4h --keep-sink 1 --json --out $OUT/recipe-sink1-t$T.json \
    --reuse $D/hamlet-4chunks-spread/plan-b0.0008-t0.9.json > $OUT/plan-sink1-t$T.json
done

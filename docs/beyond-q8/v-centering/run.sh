#!/usr/bin/env bash
# The V-centering probe of docs/beyond-q8.md, both models, both texts, the sink quantized or kept exact.
set -euo pipefail
cd "$(dirname "$0")/../../.."
for model in smollm2 gemma3-270m; do
  for corpus in britannica hamlet_gut; do
    for sink in 0 1; do
      .venv/bin/python scripts/v_centering_probe.py --model "$model" --corpus "$corpus" --test-ctx 2048 --keep-sink "$sink"
    done
  done
done

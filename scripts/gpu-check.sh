#!/usr/bin/env bash
# The GPU checks of kvlens as one script, for a machine with an NVIDIA GPU, torch and triton
# (docs/kernels.md, "Triton"). Logs go to $OUT (default out/gpu).
#   1. the Triton kernel tests, the engine's Triton path and the CUDA cache writes, compiled for the GPU
#   2. bench attention: the Triton kernel per call, every shape, f16 / q8 / q8h / q4h, 1K-64K
# A folder of wheels (gguf, for the tiny GGUF checkpoints) may be passed as $1.
set -u
OUT="${OUT:-out/gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" KVLENS_CACHE=/tmp/kvlens-cache
if [ -n "${1:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$1"/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
  python3 -c "import torch, triton, numba; print('torch', torch.__version__, 'triton', triton.__version__, 'numba', numba.__version__)"
  lscpu | grep -E 'Model name|^CPU\(s\)'; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
echo "== tests $(date -u +%T)"
timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 -k "triton or cuda" -rs \
  tests/test_kernels.py tests/test_window_kernels.py tests/test_sink_store.py tests/test_sparse.py \
  tests/test_paged_kv.py tests/test_kv_rotated_q4.py tests/test_engine_triton.py tests/test_kv_store_jit.py \
  > "$OUT/tests.txt" 2>&1
echo "rc=$?" >> "$OUT/tests.txt"
tail -n 25 "$OUT/tests.txt"
echo "== bench attention $(date -u +%T)"
timeout 200 python3 -m kvlens.cli bench attention --backend triton --shape smollm2,8b,gemma3 \
  --kv f16,q8,q8h,q4h --ctx 1k,4k,16k,64k --reps 5 > "$OUT/attention.txt" 2>&1
echo "rc=$?" >> "$OUT/attention.txt"
cat "$OUT/attention.txt"
echo "== done $(date -u +%T)"

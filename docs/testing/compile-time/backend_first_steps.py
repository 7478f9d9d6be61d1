"""The first q8 generation of each attention backend in turn, in one process with an empty cache:
run as `NUMBA_CACHE_DIR=$(mktemp -d) python backend_first_steps.py numba numba-int numba-int16`
(docs/testing.md, session 15). The first backend compiles the shared kernels too; each later one only
what it adds (its specialization of the fused decode step)."""

import sys
import time

import kvlens

llm = kvlens.load("smollm2", kv="q8", weights="f32")
for backend in sys.argv[1:]:
    t0 = time.perf_counter()
    out = llm.variant(attn_backend=backend).generate("The capital of France is", 2)
    print(f"{backend}: {time.perf_counter() - t0:.1f} s  {out!r}", flush=True)

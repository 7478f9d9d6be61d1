"""Fused and general decode steps at 4K over one mode's cache alone in the process."""
import sys
import kvlens
from kvlens.bench.decode import corpus_ids, fill_cache, time_decode, step_variant

mode, ctx = sys.argv[1], 4096
llm = kvlens.load("smollm2", kv=mode, weights="auto")
ids = corpus_ids(llm, ctx - 1)
src = llm.new_cache(ctx - 1, "f32")
llm.variant(attn_backend="torch").prefill(ids, src, chunk=512)
cache = fill_cache(llm, src, mode, ctx - 1, ctx)
del src
for r in range(3):
    for kind in ("fused", "general"):
        t = time_decode(step_variant(llm, kind), cache, ctx - 1, 12, llm.attn_backend)
        print(mode, kind, f"{1e3 * t[0]:.2f} ms", flush=True)

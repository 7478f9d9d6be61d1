"""Blocks of 12 q8 and 12 f16 decode steps at 4K, each followed by reads of a 160 MB and a 512 MB buffer."""
import sys, time, statistics
import torch, kvlens
from kvlens.bench.decode import corpus_ids, fill_cache

def gbps(b, secs=0.1):
    b.sum(); t0 = time.perf_counter(); n = 0
    while time.perf_counter() - t0 < secs:
        b.sum(); n += 1
    return n * b.numel() * 4 / (time.perf_counter() - t0) / 1e9

ctx, n = int(sys.argv[2]) if len(sys.argv) > 2 else 4096, int(sys.argv[1])
llm = kvlens.load("smollm2", kv="f16", weights="auto")
wbytes = sum(p.numel() * p.element_size() for p in llm.model.parameters()) if hasattr(llm.model, "parameters") else -1
print("param bytes (torch params)", wbytes / 2**20)
ids = corpus_ids(llm, ctx - 1)
src = llm.new_cache(ctx - 1, "f32")
llm.variant(attn_backend="torch").prefill(ids, src, chunk=512)
caches = {m: fill_cache(llm, src, m, ctx - 1, ctx) for m in ("f16", "q8")}
del src
mid = torch.ones(int(sys.argv[3]) * 2**18)
for i in range(n):
    row = []
    for m, cache in caches.items():
        ts = []
        for _ in range(12):
            t0 = time.perf_counter()
            h = llm.forward([198], cache, ctx - 1, prefill=False); llm.lm_head(h)
            ts.append(time.perf_counter() - t0); cache.truncate(ctx - 1)
        row.append(f"{m} {1 / statistics.median(ts):5.1f}")
    print(" ".join(row), f"readmid {gbps(mid):5.1f}", flush=True)

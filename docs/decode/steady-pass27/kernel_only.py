"""The decode attention kernel alone at 4K: 30 calls (a step's layers) per sample, f16 vs q8 alternating."""
import sys, time, statistics
import torch, kvlens
from kvlens.kernels.cpu import decode_attention
from kvlens.kv.cache import KVCache
from kvlens.kv.modes import KVMode

ctx, n = 4096, int(sys.argv[1])
torch.manual_seed(0)
caches = {}
for m in ("f16", "q8"):
    c = KVCache(30, 3, 64, ctx, KVMode.parse(m))
    for layer in range(30):
        c.write(layer, 0, torch.randn(3, ctx, 64), torch.randn(3, ctx, 64))
    caches[m] = c
q = torch.randn(9, 64)
res = {m: [] for m in caches}
for i in range(n):
    for m, c in caches.items():
        t0 = time.perf_counter()
        for layer in range(30):
            ks, vs = c.stores(layer) if hasattr(c, "stores") else (c.k[layer], c.v[layer])
            decode_attention(q, ks, vs, ctx)
        res[m].append(1e3 * (time.perf_counter() - t0))
for m, v in res.items():
    blk = [round(statistics.median(v[j:j + 20]), 2) for j in range(0, len(v), 20)]
    print(m, blk)

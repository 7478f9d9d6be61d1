"""The decode attention kernel at 4K, 30 layers a sample, f16 vs q8, each sample after a 512 MiB read
(the cache then comes from memory, not L3) or warm (no read between)."""
import sys, time, statistics
import numba, numpy as np, torch
from kvlens.kernels.cpu import decode_attention
from kvlens.kernels.probes import parallel_sum
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
flush = np.ones(128 * 2**20, np.float32)
res = {(m, cold): [] for m in caches for cold in (False, True)}
for i in range(n):
    for (m, cold) in res:
        c = caches[m]
        if cold:
            parallel_sum(flush, numba.get_num_threads())
        t0 = time.perf_counter()
        for layer in range(30):
            ks, vs = c.k[layer], c.v[layer]
            decode_attention(q, ks, vs, ctx)
        res[m, cold].append(1e3 * (time.perf_counter() - t0))
for (m, cold), v in res.items():
    print(m, "after a 512 MiB read" if cold else "warm", f"median {statistics.median(v):.2f} ms, min {min(v):.2f}, max {max(v):.2f}")

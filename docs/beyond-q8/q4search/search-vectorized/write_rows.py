"""ms to write CTX positions of one layer into a KVCache of each kind (min of 3), SmolLM2 and Gemma-3 shapes."""

import time

import torch

import kvlens
from kvlens.kv.cache import KVCache
from kvlens.kv.modes import KVMode

ctx = 8192
out = []
for name, (n_kv, hd) in (("smollm2", (3, 64)), ("gemma3", (1, 256))):
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(n_kv, ctx, hd, generator=gen) * 3 for _ in "kv")
    for m in ("q8", "q4", "q4h"):
        c = KVCache(1, n_kv, hd, ctx, KVMode.parse(m))
        c.write(0, 0, k[:, :64], v[:, :64])
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            c.write(0, 0, k, v)
            ts.append(time.perf_counter() - t)
        out.append(f"{name} {m} {1e3 * min(ts):.1f}")
print(kvlens.__file__, "|", " | ".join(out))

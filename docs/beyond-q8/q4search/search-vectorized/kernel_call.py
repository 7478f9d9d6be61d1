"""µs per decode-attention kernel call from Python, Gemma-3 shapes (4 query heads, 1 KV head, head_dim
256) over CTX positions of random rows, q8 and q4h stores; min and median of 5 rounds of 30 calls.

    python kernel_call.py [CTX]
"""

import sys
import time

import torch

from kvlens.kernels import cpu
from kvlens.kernels.cpu_int import IntAttn, decode_attention_int
from kvlens.kv.cache import KVCache
from kvlens.kv.modes import KVMode

ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
torch.manual_seed(0)
k, v = (torch.randn(1, ctx, 256) * 3 for _ in "kv")
q = torch.randn(4, 256)
stores = {}
for m in ("q8", "q4h"):
    cache = KVCache(1, 1, 256, ctx, KVMode.parse(m))
    cache.write(0, 0, k, v)
    stores[m] = (cache.k[0], cache.v[0])
calls = {
    "q8 numba": lambda: cpu.decode_attention(q, *stores["q8"], ctx),
    "q8 numba-int": lambda: decode_attention_int(q, *stores["q8"], ctx),
    "q8 numba-int+pv8": lambda: decode_attention_int(q, *stores["q8"], ctx, spec=IntAttn(pv8=True)),
    "q4h numba": lambda: cpu.decode_attention(q, *stores["q4h"], ctx),
    "q4h numba-int": lambda: decode_attention_int(q, *stores["q4h"], ctx),
}
res: dict[str, list[float]] = {}
for _ in range(5):
    for name, call in calls.items():
        for _ in range(3):
            call()
        t = time.perf_counter()
        for _ in range(30):
            call()
        res.setdefault(name, []).append(1e6 * (time.perf_counter() - t) / 30)
for name, us in res.items():
    us.sort()
    print(f"{name:20s} min {us[0]:7.1f} med {us[2]:7.1f} µs")

"""In one process: the float decode-attention kernel before (kvlens_old = main 5a2b268) and after the
head-pair tiles, interleaved call by call-batch; µs per call, min and median of 15 rounds of 20 calls.

    OLD_PKG_DIR=DIR python kernel_pairs.py [CTXS]

DIR holds ``kvlens_old``: a copy of the older tree's ``kvlens/`` package (its imports are relative)."""

import os
import sys
import time

import torch

from kvlens.kernels import cpu as cpu_new
from kvlens.kernels.cpu_int import decode_attention_int as int_new
from kvlens.kv.cache import KVCache
from kvlens.kv.modes import KVMode

sys.path.insert(0, os.environ["OLD_PKG_DIR"])  # holds kvlens_old: the older tree's kvlens/, copied
from kvlens_old.kernels import cpu as cpu_old  # noqa: E402
from kvlens_old.kernels.cpu_int import decode_attention_int as int_old  # noqa: E402
from kvlens_old.kv.cache import KVCache as KVCacheOld  # noqa: E402
from kvlens_old.kv.modes import KVMode as KVModeOld  # noqa: E402

torch.manual_seed(0)
shapes = {"gemma3": (4, 1, 256), "smollm2": (9, 3, 64), "8b": (32, 8, 128)}
ctxs = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "4096,8192").split(",")]
calls = {}
for shape, (H, KV, hd) in shapes.items():
    for ctx in ctxs:
        k, v = (torch.randn(KV, ctx, hd) * 3 for _ in "kv")
        q = torch.randn(H, hd)
        for m in ("f16", "q8", "q4h"):
            for tag, KC, KM, dec, dint in (
                ("old", KVCacheOld, KVModeOld, cpu_old.decode_attention, int_old),
                ("new", KVCache, KVMode, cpu_new.decode_attention, int_new),
            ):
                cache = KC(1, KV, hd, ctx, KM.parse(m))
                cache.write(0, 0, k, v)
                st = (cache.k[0], cache.v[0])
                calls.setdefault(f"{shape} {ctx} {m} numba", {})[tag] = lambda d=dec, q=q, st=st, ctx=ctx: d(
                    q, *st, ctx
                )
                if m == "q4h":
                    calls.setdefault(f"{shape} {ctx} {m} numba-int", {})[tag] = (
                        lambda d=dint, q=q, st=st, ctx=ctx: d(q, *st, ctx)
                    )
res = {}
for name, pair in calls.items():
    o, n = pair["old"](), pair["new"]()
    assert torch.allclose(o, n, rtol=1e-4, atol=1e-4 * float(o.abs().max())), name
for r in range(15):
    for name, pair in calls.items():
        for tag in ("old", "new") if r % 2 else ("new", "old"):
            call = pair[tag]
            for _ in range(2):
                call()
            t = time.perf_counter()
            for _ in range(20):
                call()
            res.setdefault((name, tag), []).append(1e6 * (time.perf_counter() - t) / 20)
print(
    f"{'call':28s} {'old min':>8s} {'new min':>8s} {'old med':>8s} {'new med':>8s}  new/old (med of per-round ratios)"
)
for name in calls:
    o, n = sorted(res[(name, "old")]), sorted(res[(name, "new")])
    ratios = sorted(b / a for a, b in zip(res[(name, "old")], res[(name, "new")], strict=True))
    print(
        f"{name:28s} {o[0]:8.1f} {n[0]:8.1f} {o[7]:8.1f} {n[7]:8.1f}  {ratios[7]:.3f} (q1-q3 {ratios[3]:.3f}-{ratios[11]:.3f})"
    )

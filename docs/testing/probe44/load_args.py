import time, torch, kvlens
from kvlens.kv.modes import CacheOptions
from kvlens.kv.blocks import SparseConfig
cases = {
 "attn_backend=bogus": dict(attn_backend="bogus"),
 "attn_backend=5": dict(attn_backend=5),
 "prefill_chunk=0": dict(prefill_chunk=0),
 "prefill_chunk=1.5": dict(prefill_chunk=1.5),
 "cache_options='x'": dict(cache_options="x"),
 "sparse='x'": dict(sparse="x"),
 "kv=5": dict(kv=5),
 "device=5": dict(device=5),
 "weights=5": dict(weights=5),
 "model=5": dict(model=5),
 "model=''": dict(model=""),
}
for name, kw in cases.items():
    t = time.time()
    try:
        kvlens.load(**kw); print(f"{name:24s} -> OK")
    except (ValueError, TypeError) as e:
        print(f"{name:24s} -> {type(e).__name__}: {str(e)[:100]}  ({time.time()-t:.1f}s)")
    except Exception as e:
        print(f"{name:24s} -> !!! {type(e).__name__}: {str(e)[:100]}")
for name, fn in {
  "CacheOptions(keep_sink=-1)": lambda: CacheOptions(keep_sink=-1),
  "CacheOptions(keep_sink=1.5)": lambda: CacheOptions(keep_sink=1.5),
  "CacheOptions(bogus=1)": lambda: CacheOptions(bogus=1),
  "SparseConfig(budget=0)": lambda: SparseConfig(budget=0),
  "SparseConfig(budget=nan)": lambda: SparseConfig(budget=float("nan")),
  "SparseConfig(method='x')": lambda: SparseConfig(method="x"),
  "SamplingParams(temperature=inf)": lambda: kvlens.SamplingParams(temperature=float("inf")),
}.items():
    try:
        r = fn(); print(f"{name:32s} -> OK {r}")
    except (ValueError, TypeError) as e:
        print(f"{name:32s} -> {type(e).__name__}: {str(e)[:100]}")
    except Exception as e:
        print(f"{name:32s} -> !!! {type(e).__name__}: {str(e)[:100]}")

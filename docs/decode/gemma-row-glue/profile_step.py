"""cProfile of ten Gemma-3 decode steps at 8K (q8, auto weights, numba, random rows), the heaviest
functions by their own time; the figures in docs/decode.md came from the tree before the row glue.

    python profile_step.py
"""

import cProfile
import io
import pstats
import time

import torch

import kvlens

torch.set_grad_enabled(False)
llm = kvlens.load("gemma3-270m", kv="q8", weights="auto", attn_backend="numba")
cfg = llm.config
ctx = 8192
cache = llm.new_cache(ctx + 16, "q8")
gen = torch.Generator().manual_seed(0)
for layer in range(cfg.n_layers):
    cache.write(layer, 0, *[torch.randn(cfg.n_kv_heads, ctx, cfg.head_dim, generator=gen) for _ in "kv"])


def step():
    h = llm.forward([198], cache, ctx, prefill=False, backend="numba")
    llm.lm_head(h)
    cache.truncate(ctx)


for _ in range(5):
    step()
ts = []
for _ in range(30):
    t = time.perf_counter()
    step()
    ts.append(time.perf_counter() - t)
print("step ms median", sorted(ts)[15] * 1e3, "min", min(ts) * 1e3)
pr = cProfile.Profile()
pr.enable()
for _ in range(10):
    step()
pr.disable()
s = io.StringIO()
st = pstats.Stats(pr, stream=s)
st.sort_stats("tottime").print_stats(25)
print(s.getvalue()[:6000])
print("calls per step", st.total_calls / 10)

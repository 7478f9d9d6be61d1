"""Python function calls and torch op events per Gemma-3 decode step (q8 cache, 1K positions of
random rows, numba kernels), for the kvlens on the path: deterministic counts beside the timings.

    python calls_per_step.py            # this tree
    OLD_PKG_DIR=DIR python calls_per_step.py old   # DIR holds kvlens_old, the older tree's kvlens/
"""

import cProfile
import os
import pstats
import sys

import torch

if sys.argv[1:] == ["old"]:
    sys.path.insert(0, os.environ["OLD_PKG_DIR"])
    import kvlens_old as kvlens
else:
    import kvlens

torch.set_grad_enabled(False)
llm = kvlens.load("gemma3-270m", kv="q8", weights="auto", attn_backend="numba")
cfg, ctx = llm.config, 1024
cache = llm.new_cache(ctx + 16, "q8")
gen = torch.Generator().manual_seed(0)
for layer in range(cfg.n_layers):
    cache.write(layer, 0, *[torch.randn(cfg.n_kv_heads, ctx, cfg.head_dim, generator=gen) for _ in "kv"])


def step() -> None:
    llm.lm_head(llm.forward([198], cache, ctx, prefill=False, backend="numba"))
    cache.truncate(ctx)


for _ in range(5):
    step()
prof = cProfile.Profile()
prof.enable()
for _ in range(10):
    step()
prof.disable()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
    step()
print(f"{kvlens.__name__}: {pstats.Stats(prof).total_calls / 10:.0f} Python calls, "
      f"{len(tp.events())} torch op events per step")  # fmt: skip

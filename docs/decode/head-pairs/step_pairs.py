"""Decode steps, before (kvlens_old = main 5a2b268) and after the head-pair tiles, in one process:
the model loaded by each package, its cache filled with random rows (the step's cost does not
depend on them), then rounds of 6 steps per (tree, mode) interleaved, order alternating per round.
Prints per (model, mode): median ms per step of each tree and the median of per-round ratios.

    OLD_PKG_DIR=DIR python step_pairs.py MODEL CTX MODES [ROUNDS]

DIR holds ``kvlens_old``: a copy of the older tree's ``kvlens/`` package (its imports are relative).
"""

import os
import sys

import torch

import kvlens
from kvlens.bench.decode import time_decode as td_new

sys.path.insert(0, os.environ["OLD_PKG_DIR"])  # holds kvlens_old: the older tree's kvlens/, copied
import kvlens_old  # noqa: E402
from kvlens_old.bench.decode import time_decode as td_old  # noqa: E402

model, ctx, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 15
torch.set_grad_enabled(False)
gen = torch.Generator().manual_seed(0)
runs = {}
for tag, pkg, td in (("old", kvlens_old, td_old), ("new", kvlens, td_new)):
    llm = pkg.load(model, kv=modes[0], weights="auto", attn_backend="numba")
    cfg = llm.config
    for m in modes:
        cache = llm.new_cache(ctx + 16, m)
        for layer in range(cfg.n_layers):
            rows = [torch.randn(cfg.n_kv_heads, ctx, cfg.head_dim, generator=gen) for _ in "kv"]
            cache.write(layer, 0, *rows)
        runs[(m, tag)] = (llm, cache, td)
res = {}
for r in range(rounds):
    for m in modes:
        for tag in ("old", "new") if r % 2 else ("new", "old"):
            llm, cache, td = runs[(m, tag)]
            res.setdefault((m, tag), []).append(td(llm, cache, ctx, 6, "numba")[0] * 1e3)
print(f"# {model} ctx {ctx}, {rounds} rounds of 6 steps, ms per step")
for m in modes:
    o, n = res[(m, "old")], res[(m, "new")]
    ratios = sorted(b / a for a, b in zip(o, n, strict=True))
    h = len(ratios) // 2
    print(
        f"{m:5s} old median {sorted(o)[h]:6.2f} min {min(o):6.2f} | new median {sorted(n)[h]:6.2f} min {min(n):6.2f} | "
        f"new/old per round: median {ratios[h]:.3f} (q1-q3 {ratios[len(ratios) // 4]:.3f}-{ratios[3 * len(ratios) // 4]:.3f})"
    )

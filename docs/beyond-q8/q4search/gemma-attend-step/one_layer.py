"""One Gemma-3 layer's decode attention as the engine's one compiled call (write, turns, kernel),
µs per call at CTX positions, for a global layer (every position) and a windowed one (its 512):
q8 and q4h interleaved over 5 rounds, random K/V rows. Prints min and median per (mode, layer).

    python one_layer.py [CTX]
"""

from __future__ import annotations

import sys
import time

import torch

import kvlens
from kvlens.engine.fused_step import attend_fused


def main() -> None:
    ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    torch.set_grad_enabled(False)
    llm = kvlens.load("gemma3-270m", kv="q8", weights="auto", attn_backend="numba")
    cfg, wins = llm.config, llm.config.layer_windows
    glob, local = wins.index(None), next(i for i, w in enumerate(wins) if w is not None)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(cfg.n_heads, 1, cfg.head_dim, generator=gen)
    k, v = (torch.randn(cfg.n_kv_heads, 1, cfg.head_dim, generator=gen) for _ in "kv")
    caches = {}
    for mode in ("q8", "q4h"):
        caches[mode] = llm.new_cache(ctx, mode)
        for layer in (glob, local):
            rows = [torch.randn(cfg.n_kv_heads, ctx - 1, cfg.head_dim, generator=gen) for _ in "kv"]
            caches[mode].write(layer, 0, *rows)

    def per_call(cache, layer: int, n: int) -> float:
        def call():
            out = attend_fused(llm.attend_step, cache, layer, q, k, v, ctx - 1, wins[layer], "numba")
            assert out is not None  # the one-call path applies

        for _ in range(5):
            call()
        t = time.perf_counter()
        for _ in range(n):
            call()
        return 1e6 * (time.perf_counter() - t) / n

    res: dict[tuple[str, str], list[float]] = {}
    for _ in range(5):
        for mode, cache in caches.items():
            for name, layer, n in (("global", glob, 40), ("window", local, 300)):
                res.setdefault((mode, name), []).append(per_call(cache, layer, n))
    for (mode, name), us in res.items():
        print(f"{mode} {name} layer: min {min(us):.1f} µs, median {sorted(us)[2]:.1f} µs per call")


if __name__ == "__main__":
    main()

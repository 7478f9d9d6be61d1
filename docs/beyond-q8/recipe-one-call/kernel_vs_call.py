"""One SmolLM2 layer's decode attention at 4K (random rows): the engine's one call
(engine.fused_step.attend_fused: write, turns, kernel) against the kernel alone
(kernels.cpu.decode_attention, once per KV head for a per-head layer), for q8 and q6h stored whole
or per KV head, with and without a sink store. Best mean µs of 5 rounds of 100 calls.

    python docs/beyond-q8/recipe-one-call/kernel_vs_call.py
"""

import dataclasses
import time

import torch

import kvlens
from kvlens.engine.fused_step import attend_fused
from kvlens.kernels import cpu
from kvlens.kv.modes import StoreKind
from kvlens.kv.recipe import head_recipe_mode

CTX, LAYER = 4096, 5


def best_us(fn, reps: int = 100) -> float:
    fn()
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e6


def kernel_us(q: torch.Tensor, ks, vs) -> float:
    """The kernel alone over the layer's stores (one call per KV head for a per-head layer)."""
    if not hasattr(ks, "parts"):
        return best_us(lambda: cpu.decode_attention(q[:, 0], ks, vs, CTX))
    g = q.shape[0] // len(ks.parts)
    return sum(
        best_us(lambda h=h: cpu.decode_attention(q[h * g : (h + 1) * g, 0], ks.parts[h], vs.parts[h], CTX))
        for h in range(len(ks.parts))
    )


def main() -> None:
    llm = kvlens.load("smollm2", kv="q8", weights="auto")
    n_layers = llm.config.n_layers
    torch.manual_seed(0)
    q, k, v = torch.randn(9, 1, 64), torch.randn(3, 1, 64), torch.randn(3, 1, 64)
    q6h, q8 = StoreKind("q6h"), StoreKind("q8")
    per_head_q6h = head_recipe_mode("r", [[(q6h, q6h)] * 3] * n_layers)
    modes = [
        ("q8 whole", "q8"),
        ("q6h whole", "q6h"),
        ("q6h per head", per_head_q6h),
        ("q6h per head sink1", dataclasses.replace(per_head_q6h, keep_sink=1)),
        ("q8 per head", head_recipe_mode("r", [[(q8, q8)] * 3] * n_layers)),
    ]
    for name, mode in modes:
        cache = llm.new_cache(CTX, mode)
        with torch.inference_mode():
            for layer in range(n_layers):
                cache.write(layer, 0, torch.randn(3, CTX - 1, 64), torch.randn(3, CTX - 1, 64))
            call = best_us(
                lambda c=cache: attend_fused(llm._attend_step, c, LAYER, q, k, v, CTX - 1, None, "numba")
            )
            alone = kernel_us(q, cache.k[LAYER], cache.v[LAYER])
        print(f"{name:22s} attend_fused {call:6.0f} µs   cpu.decode_attention {alone:6.0f} µs")


if __name__ == "__main__":
    main()

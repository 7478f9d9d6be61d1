"""Where a recipe's decode step goes: each one-call attention timed, grouped by its K and V storage
codes (stage.CODE_*: 0 q8, 4 q4, 10..12 q5h..q7h), whether it read sink rows and its query heads
(3: one KV head of a per-head layer, 9: a layer stored whole); then one layer's three per-head calls
repeated hot and after a 64 MB sweep. SmolLM2, 4K positions, the engine's own step.

    python docs/beyond-q8/recipe-one-call/recipe_split.py [MODE]   (from the repository root)
"""

import collections
import sys
import time

import numpy as np
import torch

import kvlens
from kvlens.bench.decode import corpus_ids, fill_cache
from kvlens.engine.fused_step import attend_fused
from kvlens.kernels import attend_step

RECIPE = "docs/beyond-q8/q4search/hamlet-sink-store/recipe-sink1-t0.8.json"
CTX, STEPS = 4096, 20


def instrument() -> tuple[dict, collections.Counter]:
    """Time every AttendStep.run, keyed by (K code, V code, sink rows, query heads)."""
    acc, cnt = collections.defaultdict(float), collections.Counter()
    orig = attend_step.AttendStep.run

    def run(self, attn, q, k, v, layer, pos, window, table, sink_rows=None):
        t = time.perf_counter()
        r = orig(self, attn, q, k, v, layer, pos, window, table, sink_rows)
        key = (layer[2], layer[3], sink_rows is not None, q.shape[0])
        acc[key] += time.perf_counter() - t
        cnt[key] += 1
        return r

    attend_step.AttendStep.run = run
    return acc, cnt


def hot_layer(llm, cache, layer: int, sweep: bool) -> float:
    """Best mean µs of one layer's attention call(s) over 5 rounds of 50, a 64 MB sweep before each."""
    big = np.ones(16 * 1024 * 1024, np.float32)
    q, k, v = torch.randn(9, 1, 64), torch.randn(3, 1, 64), torch.randn(3, 1, 64)
    best = 1e9
    for _ in range(5):
        total = 0.0
        for _ in range(50):
            if sweep:
                big.sum()
            t = time.perf_counter()
            attend_fused(llm._attend_step, cache, layer, q, k, v, CTX - 1, None, "numba")
            total += time.perf_counter() - t
        best = min(best, total / 50)
    return best * 1e6


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else RECIPE
    llm = kvlens.load("smollm2", kv="q8", weights="auto")
    acc, cnt = instrument()
    with torch.inference_mode():
        src = llm.new_cache(CTX - 1, "f32")
        llm.prefill(corpus_ids(llm, CTX - 1), src, 512)
        cache = fill_cache(llm, src, mode, CTX - 1, CTX)

        def step() -> None:
            llm.lm_head(llm.forward([198], cache, CTX - 1, prefill=False))
            cache.truncate(CTX - 1)

        for _ in range(3):
            step()
        acc.clear()
        cnt.clear()
        t = time.perf_counter()
        for _ in range(STEPS):
            step()
        print(f"ms/step {(time.perf_counter() - t) / STEPS * 1e3:.2f}")
        for key in sorted(acc, key=lambda x: -acc[x]):
            k_code, v_code, sink, heads = key
            print(
                f"K code {k_code:2d} V code {v_code:2d} sink {int(sink)} q {heads}: calls/step "
                f"{cnt[key] / STEPS:5.1f}  µs/call {acc[key] / cnt[key] * 1e6:6.1f}  ms/step {acc[key] / STEPS * 1e3:5.2f}"
            )
        print(f"total attn ms/step {sum(acc.values()) / STEPS * 1e3:.2f}")
        print(f"layer 5 hot: {hot_layer(llm, cache, 5, False):.0f} µs per layer (3 head calls)")
        print(f"layer 5 after a 64 MB sweep: {hot_layer(llm, cache, 5, True):.0f} µs")


if __name__ == "__main__":
    main()

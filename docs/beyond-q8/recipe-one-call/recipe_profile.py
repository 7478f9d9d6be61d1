"""cProfile of a recipe's decode step: 10 steps of SmolLM2 at 4K positions through the engine's own
step (after 3 warm-up steps), the 22 functions of most own time. Run against the eighteenth session's
tree (``c35edd0``) it showed where the hamlet recipe's step went before its layers took the compiled
calls (recipe_profile-c35edd0.txt).

    python docs/beyond-q8/recipe-one-call/recipe_profile.py [MODE]   (from the repository root)
"""

import cProfile
import pstats
import sys
import time

import torch

import kvlens
from kvlens.bench.decode import corpus_ids, fill_cache

RECIPE = "docs/beyond-q8/q4search/hamlet-sink-store/recipe-sink1-t0.8.json"
CTX = 4096


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else RECIPE
    llm = kvlens.load("smollm2", kv="q8", weights="auto")
    with torch.inference_mode():
        src = llm.new_cache(CTX - 1, "f32")
        llm.prefill(corpus_ids(llm, CTX - 1), src, 512)
        cache = fill_cache(llm, src, mode, CTX - 1, CTX)

        def step() -> None:
            llm.lm_head(llm.forward([198], cache, CTX - 1, prefill=False))
            cache.truncate(CTX - 1)

        for _ in range(3):
            step()
        t = time.perf_counter()
        for _ in range(10):
            step()
        print(f"ms/step {(time.perf_counter() - t) / 10 * 1e3:.1f} (unprofiled)")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(10):
            step()
        profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()

"""s to prefill N positions of the corpus text into a q8 and a q4h cache (SmolLM2, weights auto, min of 2)."""

import sys
import time

import torch

import kvlens
from kvlens.corpus import load_corpus

torch.set_grad_enabled(False)
n = int(sys.argv[1])
llm = kvlens.load("smollm2", weights="auto")
ids = llm.tokenizer.encode(load_corpus(None)[0])[:n]
out = []
for m in ("q8", "q4h"):
    ts = []
    for _ in range(2):
        cache = llm.new_cache(n, m)
        t = time.perf_counter()
        llm.prefill(ids, cache)
        ts.append(time.perf_counter() - t)
    out.append(f"{m} {min(ts):.2f} s")
print(kvlens.__file__, "|", " | ".join(out))

"""Hostile Python API calls: each must raise ValueError or TypeError naming the problem ("ok"); a
call that runs ("NO ERROR") or raises anything else ("OTHER") is a finding, unless the call is valid.

Usage: .venv/bin/python docs/testing/bad-input-sweep/api_probe.py
"""

import torch

import kvlens
from kvlens.engine.sampling import SamplingParams

llm = kvlens.load("smollm2", kv="q8", prefill_chunk=32)


def probe(name, f):
    try:
        r = f()
        print(f"NO ERROR {name}: {str(r)[:80]!r}")
    except (ValueError, TypeError) as e:
        print(f"ok {name}: {type(e).__name__}: {str(e)[:120]}")
    except Exception as e:
        print(f"OTHER {name}: {type(e).__name__}: {str(e)[:150]}")


probe("generate max_new_tokens -1", lambda: llm.generate("hi", max_new_tokens=-1))
probe("generate max_new_tokens 2.5", lambda: llm.generate("hi", max_new_tokens=2.5))
probe("generate prompt bytes", lambda: llm.generate(b"hi", max_new_tokens=2))
probe("generate prompt None", lambda: llm.generate(None, max_new_tokens=2))
probe("generate prompt surrogate", lambda: llm.generate("\ud800", max_new_tokens=2))
probe("generate sampling dict", lambda: llm.generate("hi", max_new_tokens=2, sampling={"temperature": 1.0}))
probe("sampling temperature nan", lambda: SamplingParams(temperature=float("nan")))
probe("sampling top_p 0", lambda: SamplingParams(top_p=0.0))
probe("sampling top_k -1", lambda: SamplingParams(top_k=-1))
probe("sampling seed str", lambda: SamplingParams(seed="x"))
probe("generate_ids oob", lambda: list(llm.generate_ids([1, 10**9], 2)))
probe("generate_ids empty", lambda: list(llm.generate_ids([], 2)))
probe("generate_ids floats", lambda: list(llm.generate_ids([1.5, 2.0], 2)))
probe("generate_ids tensor float", lambda: list(llm.generate_ids(torch.tensor([1.0, 2.0]), 2)))
probe("logits oob", lambda: llm.logits([1, 49152]))
probe("logits prefill_chunk 0", lambda: llm.logits([1, 2], prefill_chunk=0))
probe("new_cache -1", lambda: llm.new_cache(-1))
probe("new_cache huge", lambda: llm.new_cache(10**15))
probe("new_cache kv zz", lambda: llm.new_cache(8, "zz"))
probe("variant kv zz", lambda: llm.variant(kv="zz"))
probe("forward pos neg", lambda: llm.forward([1], llm.new_cache(8), -1))
probe("forward past capacity (valid: the cache grows)", lambda: llm.forward([1, 2, 3], llm.new_cache(2), 0))
probe("forward gap", lambda: llm.forward([1], llm.new_cache(8), 5))
probe("load kv int", lambda: kvlens.load("smollm2", kv=8))
probe("load weights zz", lambda: kvlens.load("smollm2", weights="zz"))
probe("load prefill_chunk 0", lambda: kvlens.load("smollm2", prefill_chunk=0))
probe("load prefill_chunk True", lambda: kvlens.load("smollm2", prefill_chunk=True))
probe("load model int", lambda: kvlens.load(5))
probe("load attn_backend zz", lambda: kvlens.load("smollm2", attn_backend="zz"))
probe("encode_prompt int", lambda: llm.encode_prompt(5))

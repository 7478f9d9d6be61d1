"""``kvlens serve`` warms up before it listens: after :func:`kvlens.serve.cli.warm_up`, serving real
requests (alone, batched, prompts of several prefill chunks, a prefix-cache hit) compiles nothing.
That the served engine's counters start at zero is checked on a real server (test_serve_http)."""

from __future__ import annotations

import numba.core.dispatcher
import pytest

import kvlens
from kvlens.engine.scheduler import Engine, EngineConfig, Request
from kvlens.serve.cli import warm_up


@pytest.fixture(scope="module")
def warmed(smol_path):
    # as `kvlens serve` loads it: the GGUF's own weight kinds (int4 layers, int8 embedding and head,
    # whose prefill of more than a few rows takes the dequantize-then-GEMM path), prefix unit 32
    llm = kvlens.load(smol_path, kv="q8", prefill_chunk=32)
    seconds = warm_up(llm)
    return llm, seconds


def test_served_requests_compile_nothing_after_warm_up(warmed, monkeypatch):
    llm, seconds = warmed
    assert seconds > 0
    compiled: list[str] = []
    compile_method = numba.core.dispatcher.Dispatcher.compile

    def counting(self, sig):
        if sig not in self.overloads:  # a signature this process has no machine code for yet
            compiled.append(f"{self.py_func.__qualname__}{sig}")
        return compile_method(self, sig)

    monkeypatch.setattr(numba.core.dispatcher.Dispatcher, "compile", counting)
    engine = Engine(llm, EngineConfig(kv_budget_bytes=1 << 24, prefix_cache=True, max_batch=4))
    text = "The quick brown fox jumps over the lazy dog. " * 5
    prompts = [llm.encode_prompt(text), llm.encode_prompt(text[:60]), llm.encode_prompt("Hi")]
    for round_ in range(2):  # the second round hits the prefix cache
        for i, ids in enumerate(prompts):
            engine.add_request(Request(f"r{round_}-{i}", ids, max_tokens=4))
            if i == 0:
                engine.step()  # the first one alone for a step: a one-sequence decode, then a batch
        for _ in range(1000):
            if not engine.has_unfinished():
                break
            engine.step()
    assert not engine.has_unfinished()
    assert engine.prefix.stats.hit_tokens > 0
    assert compiled == [], "\n".join(c[:90] for c in compiled)

"""``kvlens bench decode``: full-model decode tokens/s per cache mode and context, side by side.

Every context is filled once with real K/V (an f32 prefill of corpus text); each mode's cache is
then written from those rows through its own store (so q8 rows are really quantized), and decode
steps are timed on top. Modes at one context are timed in one run, interleaved, so the ratios
printed compare like with like on a noisy machine. HF transformers' ``generate`` on the same
weights (default dynamic cache) is timed in the same run for reference.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass

import psutil
import torch

from ..engine.llm import LLM
from ..kv.cache import KVCache


@dataclass
class DecodeRow:
    engine: str
    mode: str
    ctx: int
    tok_per_s: float
    ms_per_tok: float
    kv_bytes: int
    rss_bytes: int
    backend: str
    attn_ms: float | None = None  # per step, all layers: time inside attend (KV write + attention)
    kv_write_ms: float | None = None  # the KV-write part of attn_ms (finite check, quantize, store)

    def as_dict(self) -> dict:
        return asdict(self)


def corpus_ids(llm: LLM, n: int) -> list[int]:
    """n real-text token ids (the default corpus, repeated if it is short)."""
    from ..lab.corpus import load_corpus

    text, _ = load_corpus(None)
    ids = llm.tokenizer.encode(text)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def fill_cache(llm: LLM, source: KVCache, mode: str, length: int, capacity: int) -> KVCache:
    """A cache of ``mode`` holding the first ``length`` rows of an f32 ``source`` cache."""
    cache = llm.new_cache(capacity, mode)
    for layer in range(llm.config.n_layers):
        k, v = source.read(layer, length)
        cache.write(layer, 0, k, v)
    return cache


class _AttendClock:
    """Sums the seconds spent inside ``attend`` and inside ``cache.write`` while installed.

    It wraps the ``attend`` callback that ``llm.forward`` hands to ``model.forward`` (the documented
    AttendFn contract) and the cache's ``write``, on these two instances only, so the timed step is
    the engine's own forward; a few perf_counter calls per layer cost ~1 µs each."""

    def __init__(self, llm: LLM, cache: KVCache) -> None:
        self.model, self.cache = llm.model, cache
        self.attend_s = self.write_s = 0.0

    def __enter__(self) -> _AttendClock:
        forward, write = self.model.forward, self.cache.write

        def timed_write(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return write(*args, **kwargs)
            finally:
                self.write_s += time.perf_counter() - t0

        def timed_forward(ids, start, attend):
            def timed_attend(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return attend(*args, **kwargs)
                finally:
                    self.attend_s += time.perf_counter() - t0

            return forward(ids, start, timed_attend)

        self.model.forward, self.cache.write = timed_forward, timed_write  # instance attributes
        return self

    def __exit__(self, *exc) -> None:
        del self.model.forward, self.cache.write  # back to the class methods

    def reset(self) -> None:
        self.attend_s = self.write_s = 0.0


@torch.inference_mode()
def time_decode(
    llm: LLM, cache: KVCache, pos: int, steps: int, backend: str, warmup: int = 2
) -> tuple[float, float, float]:
    """Median seconds per decode step at position ``pos`` (the cache holds ``pos`` rows, the step
    attends ``pos + 1``), and of its time in attention and in KV writes (all layers); the cache is
    rewound after every step."""
    tok = 198  # any id: the cost of a step does not depend on it
    times, attn, write = [], [], []
    with _AttendClock(llm, cache) as clock:
        for i in range(warmup + steps):
            clock.reset()
            t0 = time.perf_counter()
            h = llm.forward([tok], cache, pos, prefill=False, backend=backend)
            llm.model.logits(h)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                attn.append(clock.attend_s)
                write.append(clock.write_s)
            cache.truncate(pos)
    med = len(times) // 2  # median: robust to the odd descheduled step
    return sorted(times)[med], sorted(attn)[med], sorted(write)[med]


class _TokenClock:
    """A ``generate`` streamer that timestamps every new token (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_decode_time(llm: LLM, ids: list[int], steps: int) -> float | None:
    """Median seconds per decode step of HF transformers' greedy ``generate`` after a ``len(ids)`` prompt."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    src = llm.source
    kwargs = {"gguf_file": src.name} if src.suffix == ".gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(
        src.parent if src.suffix == ".gguf" else src, dtype=torch.float32, **kwargs
    ).eval()
    clock = _TokenClock()
    with torch.inference_mode():
        model.generate(
            torch.tensor([ids]),
            max_new_tokens=steps + 2,
            min_new_tokens=steps + 2,
            do_sample=False,
            streamer=clock,
        )
    del model
    gc.collect()
    # stamps: prompt, token 1 (after prefill), then one per decode step; skip the first step (warm-up)
    deltas = sorted(b - a for a, b in zip(clock.stamps[2:], clock.stamps[3:], strict=False))
    return deltas[len(deltas) // 2]


def run_decode_bench(
    llm: LLM,
    contexts: list[int],
    modes: list[str],
    steps: int = 16,
    backend: str | None = None,
    with_hf: bool = True,
    progress=None,
) -> list[DecodeRow]:
    backend = backend or llm.attn_backend
    rows: list[DecodeRow] = []
    for ctx in contexts:
        # the timed step attends exactly ctx positions (ctx - 1 cached + itself): ctx may be the
        # model's whole window (SmolLM2: 8192)
        llm.check_fits(ctx)
        ids = corpus_ids(llm, ctx - 1)
        source = llm.new_cache(ctx - 1, "f32")
        llm.prefill(ids, source, chunk=512)
        caches = {m: fill_cache(llm, source, m, ctx - 1, ctx) for m in modes}
        del source
        gc.collect()
        per_mode: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
        for _ in range(3):  # interleave the modes so drift hits them alike
            for m in modes:
                per_mode[m].append(time_decode(llm, caches[m], ctx - 1, max(steps // 3, 2), backend))
        rss = psutil.Process().memory_info().rss
        for m in modes:
            t, attn, write = (sorted(x)[1] for x in zip(*per_mode[m], strict=True))  # medians of 3 rounds
            rows.append(
                DecodeRow(
                    "kvlens",
                    m,
                    ctx,
                    1 / t,
                    1e3 * t,
                    caches[m].bytes_per_token() * ctx,
                    rss,
                    backend,
                    1e3 * attn,
                    1e3 * write,
                )
            )
        del caches
        gc.collect()
        if with_hf:
            t = hf_decode_time(llm, ids, steps)
            if t is not None:
                rows.append(
                    DecodeRow(
                        "transformers",
                        "f32 (DynamicCache)",
                        ctx,
                        1 / t,
                        1e3 * t,
                        2 * llm.config.n_layers * llm.config.n_kv_heads * llm.config.head_dim * 4 * ctx,
                        psutil.Process().memory_info().rss,
                        "sdpa",
                    )
                )
        if progress:
            progress(ctx)
    return rows

"""Where one decode step's time goes: per part of a layer, Python/dispatch overhead, op counts.

    python scripts/profile_decode_step.py [--ctx 512] [--kv q8] [--weights auto]
        [--attn-backend numba] [--steps 40] [--clock thread|wall] [--counts] [--unfused]

Fills a cache of ``ctx - 1`` positions with real text, then times decode steps (one token at
``ctx - 1``, LM head included, cache rewound after each). Parts are timed by wrapping the engine's
functions for the duration of the run (the engine itself has no per-part clocks: they would cost
every step). ``--clock thread`` (default) reads this thread's CPU time, which a busy shared box does
not inflate while the process waits for a core; it measures the whole step only when the kernels run
on this one thread, so run with ``NUMBA_NUM_THREADS=1`` (the script refuses otherwise).
``--counts`` adds the torch op count (torch.profiler) and the Python call count (cProfile) per step.
``--unfused`` profiles the general path (each layer's parts as separate calls) instead of the
one-call-per-layer step (``LLM.fused_step = False``).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import time
from collections.abc import Callable

import numba
import torch

import kvlens
from kvlens.bench.decode import corpus_ids
from kvlens.engine import attention as attention_mod
from kvlens.kernels import rowops
from kvlens.kv import cache as cache_mod
from kvlens.models import transformer as transformer_mod


class Parts:
    """Seconds and calls per part name, summed over the timed steps."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock, self.sec, self.calls = clock, collections.Counter(), collections.Counter()

    def wrap(self, fn: Callable, label: str | Callable[..., str]) -> Callable:
        def timed(*args, **kwargs):
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                name = label(*args) if callable(label) else label
                self.sec[name] += self.clock() - t0
                self.calls[name] += 1

        return timed


def patch(obj, name: str, new, undo: list) -> None:
    undo.append((obj, name, getattr(obj, name)))
    setattr(obj, name, new)


def instrument(llm, parts: Parts, undo: list) -> None:
    """Wrap whichever of the step's functions this version of the engine has."""
    names = {id(llm.model.w.lm_head): "lm_head"}
    for L in llm.model.w.layers:
        names |= {id(L.wqkv): "qkv", id(L.wo): "o_proj", id(L.w_gate_up): "gate_up", id(L.w_down): "down"}
    patch(
        transformer_mod, "linear", parts.wrap(transformer_mod.linear, lambda x, w, b=None: names[id(w)]), undo
    )
    for fn, label in (("rms_norm_row", "norm"), ("rope_split_row", "rope"), ("silu_mul_row", "silu")):
        if hasattr(rowops, fn):
            patch(rowops, fn, parts.wrap(getattr(rowops, fn), label), undo)
    patch(cache_mod.KVCache, "write", parts.wrap(cache_mod.KVCache.write, "kv_write"), undo)
    fused = attention_mod._fused_kernel
    patch(attention_mod, "_fused_kernel", lambda b: parts.wrap(fused(b), "attn_kernel"), undo)
    for cls, fn in ((transformer_mod.Transformer, "layer"),):
        patch(cls, fn, parts.wrap(getattr(cls, fn), "layer_total"), undo)
    if llm.fused is not None:  # the one-call-per-layer path (kernels/decode_step.py)
        patch(llm.fused, "run", parts.wrap(llm.fused.run, "fused_layers"), undo)


def report(parts: Parts, steps: int, step_s: float) -> None:
    print(f"instrumented step: {1e3 * step_s:.3f} ms")
    for name, s in sorted(parts.sec.items(), key=lambda kv: -kv[1]):
        calls = parts.calls[name]
        print(
            f"  {name:13s} {1e3 * s / steps:8.3f} ms/step {calls // steps:4d} calls/step {1e6 * s / calls:8.2f} us/call"
        )
    inner = sum(s for n, s in parts.sec.items() if n not in ("layer_total", "lm_head", "fused_layers"))
    if parts.sec["layer_total"]:
        print(
            f"  layer glue (layer_total - its timed parts): {1e3 * (parts.sec['layer_total'] - inner) / steps:.3f} ms/step"
        )
    outer = step_s - (parts.sec["layer_total"] + parts.sec["fused_layers"] + parts.sec["lm_head"]) / steps
    print(f"  outside the layers (embedding, final norm, set-up, LM-head wrapper): {1e3 * outer:.3f} ms/step")


def counts(step: Callable[[], None], n: int = 10) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step()
    ops = sum(e.count for e in prof.key_averages()) / n
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        step()
    pr.disable()
    calls = pstats.Stats(pr).total_calls / n
    print(
        f"per step: {ops:.0f} torch op events (torch.profiler), {calls:.0f} Python function calls (cProfile)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--kv", default="q8")
    p.add_argument("--weights", default="auto")
    p.add_argument("--attn-backend", default="numba")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--clock", choices=("thread", "wall"), default="thread")
    p.add_argument("--counts", action="store_true")
    p.add_argument("--unfused", action="store_true")
    a = p.parse_args()
    if a.clock == "thread" and numba.get_num_threads() != 1:
        raise SystemExit("error: --clock thread needs NUMBA_NUM_THREADS=1 (the kernels on this thread)")
    clock = time.thread_time if a.clock == "thread" else time.perf_counter
    llm = kvlens.load("smollm2", kv=a.kv, weights=a.weights, attn_backend=a.attn_backend)
    llm.fused_step = not a.unfused
    cache = llm.new_cache(a.ctx, a.kv)
    llm.prefill(corpus_ids(llm, a.ctx - 1), cache)
    pos = a.ctx - 1

    def step() -> None:
        llm.lm_head(llm.forward([198], cache, pos, prefill=False))
        cache.truncate(pos)

    for _ in range(5):
        step()
    times = []
    for _ in range(a.steps):
        t0 = clock()
        step()
        times.append(clock() - t0)
    times.sort()
    print(
        f"{'unfused' if a.unfused else 'fused'} {a.attn_backend}, kv {a.kv}, weights {a.weights}, ctx {a.ctx}, "
        f"{numba.get_num_threads()} thread(s), "
        f"{a.clock} clock, load average {os.getloadavg()[0]:.2f}: step median {1e3 * times[len(times) // 2]:.3f} ms, "
        f"min {1e3 * times[0]:.3f} ms"
    )
    parts, undo = Parts(clock), []
    instrument(llm, parts, undo)
    try:
        for _ in range(3):
            step()
        parts.sec.clear()
        parts.calls.clear()
        t0 = clock()
        for _ in range(a.steps):
            step()
        report(parts, a.steps, (clock() - t0) / a.steps)
    finally:
        for obj, name, old in reversed(undo):
            setattr(obj, name, old)
    if a.counts:
        with torch.inference_mode():
            counts(step)


if __name__ == "__main__":
    main()

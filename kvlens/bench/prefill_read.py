"""``kvlens bench attention --prefill``: what a prefill sub-chunk over a cache pays to read the history
as f32 (the engine's torch path: dequantize int8, widen f16) beside the SDPA that follows."""

from __future__ import annotations

import time

import torch

from ..kernels.reference import sdpa_attention
from .attention import SHAPES, build_layers


def time_prefill_read(shape: str = "smollm2", history: int = 4096, chunk: int = 32, reps: int = 20):
    """The engine's prefill over a cache: per layer and ``chunk``-token sub-chunk, ms to read the whole
    history as f32 (``KVCache.read``: dequantize int8 / widen f16) vs ms of the SDPA that follows.

    Returns ``{mode: (read_ms, sdpa_ms)}`` for f32, f16 and q8 (min over ``reps``)."""
    n_heads, n_kv, hd = SHAPES[shape]
    end = history + chunk
    q = torch.randn(n_heads, chunk, hd)
    q_pos = torch.arange(history, end)
    out = {}
    for m in ("f32", "f16", "q8"):
        ks, vs = build_layers(m, 1, n_kv, end, hd, torch.device("cpu"))[0]
        t_read, t_sdpa = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            k, v = ks.read(0, end), vs.read(0, end)
            t1 = time.perf_counter()
            sdpa_attention(q, k, v, q_pos)
            t_sdpa.append(time.perf_counter() - t1)
            t_read.append(t1 - t0)
        out[m] = (1e3 * min(t_read), 1e3 * min(t_sdpa))
    return out


def render_prefill(shape: str, history: int, chunk: int, res: dict[str, tuple[float, float]]) -> None:
    print(f"\nprefill over a cache ({shape}, one layer, {chunk}-token sub-chunk after {history} positions):")
    print("| mode | read history as f32 (ms) | SDPA (ms) | read / SDPA |\n|---|---|---|---|")
    for m, (rd, sd) in res.items():
        print(f"| {m} | {rd:.3f} | {sd:.3f} | {rd / sd:.2f} |")

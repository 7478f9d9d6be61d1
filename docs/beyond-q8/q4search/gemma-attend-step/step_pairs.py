"""Gemma-3 decode steps at one context, modes interleaved step by step (ABAB..., the order flipped
every pair), on a contiguous cache or a serving pool's paged view: the median ms per step of each
mode and the median of the per-pair speed ratios (each pair of adjacent steps shares the machine's
state, so the ratio is steadier than a ratio of medians on a box whose speed drifts).

    python step_pairs.py CTX MODES [--paged] [--pairs N]

MODES: comma-separated cache modes; a mode written ``MODE/general`` runs every layer's parts as
separate calls (``LLM.fused_step = False``) over its own cache of that mode, interleaved with the
rest. The caches are filled from an f32 prefill of the default corpus, each mode's rows written
through its own store. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import kvlens
from kvlens.bench.decode import corpus_ids, fill_cache
from kvlens.kv.modes import KVMode
from kvlens.kv.pool import BlockPool, PagedKV, kv_bytes_per_token


def paged_copy(llm, src, mode: str, n: int) -> PagedKV:
    cfg, kv = llm.config, KVMode.parse(mode)
    per_token = kv_bytes_per_token(kv, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
    pool = BlockPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, kv, (n + 96) * per_token)
    PagedKV(pool).grow(40)  # another sequence's blocks first: the table does not start at block 0
    seq = PagedKV(pool)
    seq.grow(n + 1)
    for layer in range(cfg.n_layers):
        k, v = src.read(layer, n)
        seq.write(layer, 0, k, v)
    return seq


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ctx", type=int)
    ap.add_argument("modes")
    ap.add_argument("--paged", action="store_true")
    ap.add_argument("--pairs", type=int, default=30)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    llm = kvlens.load("gemma3-270m", kv="q8", weights="auto", attn_backend="numba")
    general = llm.variant(fused_step=False)
    modes, pos = a.modes.split(","), a.ctx - 1
    src = llm.new_cache(pos, "f32")
    llm.variant(attn_backend="torch").prefill(corpus_ids(llm, pos), src, chunk=512)
    kinds = {m: m.split("/")[0] for m in modes}
    caches = {
        m: paged_copy(llm, src, kind, pos) if a.paged else fill_cache(llm, src, kind, pos, a.ctx)
        for m, kind in kinds.items()
    }

    def step(m: str) -> float:
        engine = general if m.endswith("/general") else llm
        t = time.perf_counter()
        engine.lm_head(engine.forward([198], caches[m], pos, prefill=False))
        return time.perf_counter() - t  # the next step writes the same position again

    for m in modes:
        for _ in range(3):
            step(m)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(a.pairs):
        for m in modes if i % 2 == 0 else modes[::-1]:
            times[m].append(step(m))
    base = times[modes[0]]
    out = {"ctx": a.ctx, "paged": a.paged, "pairs": a.pairs}
    for m in modes:
        ratios = [b / t for b, t in zip(base, times[m], strict=True)]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        out[m] = {
            "median_ms": round(1e3 * statistics.median(times[m]), 2),
            "min_ms": round(1e3 * min(times[m]), 2),
            f"speed_x_{modes[0]}": round(statistics.median(ratios), 3),
            "ratio_q1_q3": [round(q1, 3), round(q3, 3)],
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Aggregate decode tokens/s of the serving engine at several batch sizes, side by side in one run.

Each batch size B runs B requests (different prompts cut from one text, ``prompt_len`` tokens each)
through one :class:`~kvlens.engine.scheduler.Engine`; once every prompt is prefilled, ``steps`` pure
decode steps are timed (best of ``rounds``). The row "loop" is the LLM's own one-sequence loop over a
contiguous cache (``generate_ids(cache=...)``), the single-stream decode before the engine.

    python -m kvlens.bench.engine_decode --kv q8 --weights auto --batches 1,4,8,16
"""

from __future__ import annotations

import argparse
import time

from ..engine.llm import LLM, load
from ..engine.serving import Engine, EngineConfig, Request
from ..kv.cache import BLOCK
from ..kv.pool import kv_bytes_per_token

TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how "
    "books were made, sold and read across Europe. Within a few decades presses were running in more "
    "than two hundred cities, and the price of a book fell so far that students could own them. "
) * 8


def _requests(llm: LLM, batch: int, prompt_len: int, new: int) -> list[Request]:
    ids = llm.tokenizer.encode(TEXT)
    if len(ids) < prompt_len + batch:
        raise ValueError(f"prompt_len {prompt_len} is longer than the benchmark text allows")
    return [Request(f"r{b}", ids[b : b + prompt_len], new, stop_ids=frozenset()) for b in range(batch)]


def engine_rate(llm: LLM, batch: int, prompt_len: int = 64, steps: int = 16, rounds: int = 3) -> float:
    """Aggregate decode tokens/s of ``batch`` sequences decoding together (best of ``rounds``)."""
    cfg = llm.config
    per_seq = -(-(prompt_len + steps + 2) // BLOCK)
    budget = batch * per_seq * BLOCK * kv_bytes_per_token(llm.kv, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
    best = 0.0
    for _ in range(rounds):
        engine = Engine(llm, EngineConfig(kv_budget_bytes=budget, max_batch=batch, prefill_token_budget=4096))
        for r in _requests(llm, batch, prompt_len, steps + 2):
            engine.add_request(r)
        while any(s.in_prefill for s in engine.running) or engine.waiting:
            engine.step()
        engine.step()  # every sequence now decodes
        t0 = time.perf_counter()
        tokens = sum(len(engine.step()) for _ in range(steps))
        best = max(best, tokens / (time.perf_counter() - t0))
    return best


def loop_rate(llm: LLM, prompt_len: int = 64, steps: int = 16, rounds: int = 3) -> float:
    """Single-stream tokens/s of the LLM's own decode loop over a contiguous cache."""
    (req,) = _requests(llm, 1, prompt_len, steps + 1)
    best = 0.0
    for _ in range(rounds):
        gen = llm.generate_ids(
            req.prompt_ids, steps + 1, stop_at_eos=False, cache=llm.new_cache(prompt_len + steps + 1)
        )
        next(gen)  # the prefill
        t0 = time.perf_counter()
        n = sum(1 for _ in gen)
        best = max(best, n / (time.perf_counter() - t0))
    return best


def measure(
    model: str = "smollm2",
    kv: str = "q8",
    weights: str = "auto",
    batches: tuple[int, ...] = (1, 4, 8, 16),
    prompt_len: int = 64,
    steps: int = 16,
) -> list[dict]:
    """Rows ``{"batch", "tok_s", "vs_batch1"}`` plus the contiguous loop's single-stream row."""
    llm = load(model, kv=kv, weights=weights)
    rows = [{"batch": "loop", "tok_s": loop_rate(llm, prompt_len, steps)}]
    for b in batches:
        rows.append({"batch": b, "tok_s": engine_rate(llm, b, prompt_len, steps)})
    base = next((r["tok_s"] for r in rows if r["batch"] == 1), rows[0]["tok_s"])
    for r in rows:
        r["vs_batch1"] = r["tok_s"] / base
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--kv", default="q8")
    p.add_argument("--weights", default="auto")
    p.add_argument("--batches", default="1,4,8,16")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=16)
    a = p.parse_args()
    rows = measure(
        a.model, a.kv, a.weights, tuple(int(b) for b in a.batches.split(",")), a.prompt_len, a.steps
    )
    print(f"engine decode, {a.model}, kv {a.kv}, weights {a.weights}, prompt {a.prompt_len}, {a.steps} steps")
    print(f"{'batch':>6} {'tok/s':>9} {'x batch 1':>10}")
    for r in rows:
        print(f"{r['batch']!s:>6} {r['tok_s']:9.1f} {r['vs_batch1']:10.2f}")


if __name__ == "__main__":
    main()

"""``kvlens bench serve --scenario multiturn``: K users each hold a chat of N turns.

Every user's conversation is a system prompt (shared by all users, as one application's users
share it) and a growing history; each turn sends the WHOLE conversation so far as a streamed chat
completion (``ignore_eos``, ``output_len`` tokens), then appends the reply. User turns are token
windows cut from the corpus at seeded offsets. At most ``concurrency`` requests are in flight.

Per turn it reports TTFT (median, p90) and the prefill tokens the server actually computed:
``usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens`` (``n/a`` where the server does
not report cached tokens). The same load runs against one server per (KV mode, arm):

- ``no-cache``: ``--no-prefix-cache`` (every turn prefills the whole conversation: recompute);
- ``cache``: the default server (prefix cache on);
- ``disk``: prefix cache + ``--kv-disk`` with a pool sized to hold about a third of the final
  conversations (the bench chooses ``--kv-budget`` from the conversation sizes and prints it);
- ``small``: that same small pool without the disk tier (evicted prefixes are recomputed).

An arm whose server options this kvlens lacks is skipped with a line saying so.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

import numpy as np

from ..models.tokenizer import Tokenizer
from .openai_stream import open_stream

SYSTEM_HEAD = "You are a helpful assistant. Answer the user's questions about this reference text.\n\n"
ARMS = ("no-cache", "cache", "disk", "small")
ARM_FLAGS = {"no-cache": "--no-prefix-cache", "disk": "--kv-disk", "small": None, "cache": None}
PREFIX_METRICS = (
    "kvlens_prefix_hit_tokens_total",
    "kvlens_prompt_tokens_total",
    "kvlens_kv_disk_blocks_spilled_total",
    "kvlens_kv_disk_blocks_restored_total",
)


@dataclass(frozen=True)
class MultiturnLoad:
    users: int
    turns: int
    system_len: int  # corpus tokens in the system prompt (after SYSTEM_HEAD)
    turn_len: int  # tokens of each user turn
    output_len: int
    concurrency: int
    seed: int = 0


@dataclass(frozen=True)
class Conversation:
    system: str
    user_turns: tuple[str, ...]


@dataclass
class TurnSample:
    user: int
    turn: int  # 1-based
    ok: bool
    error: str | None = None
    ttft: float = float("nan")
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # None: the server did not say
    output_tokens: int = 0


@dataclass
class TurnRow:
    """One turn of one run, over its users."""

    engine: str
    kv: str
    arm: str
    concurrency: int
    turn: int
    requests: int
    failed: int
    ttft_p50: float
    ttft_p90: float
    prompt_tokens: float
    cached_tokens: float | None
    computed_tokens: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def conversations(tok: Tokenizer, corpus: str | None, load: MultiturnLoad) -> list[Conversation]:
    """``load.users`` conversations: one shared system prompt, ``turns`` user turns each."""
    from .serve import corpus_prompts

    n = 1 + load.users * load.turns
    windows = corpus_prompts(tok, corpus, n, max(load.system_len, load.turn_len), load.seed)
    system = SYSTEM_HEAD + tok.decode(windows[0][: load.system_len]).strip()
    texts = [tok.decode(w[: load.turn_len]).strip() for w in windows[1:]]
    return [
        Conversation(system, tuple(texts[u * load.turns : (u + 1) * load.turns])) for u in range(load.users)
    ]


def conversation_tokens(tok: Tokenizer, conv: Conversation, output_len: int, turns: int | None = None) -> int:
    """Tokens of the conversation after the reply of its turn ``turns`` (default: the last; 0: the
    system message alone, the prefix all users share), replies stood in by user-turn text cut to
    ``output_len`` tokens: what the pool must hold to keep it."""
    messages = [{"role": "system", "content": conv.system}]
    for text in conv.user_turns[:turns]:
        reply = tok.decode(tok.encode(text, add_bos=False)[:output_len])
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
    return len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False), add_bos=False))


async def _chat_turn(client, model: str, messages: list[dict], output_len: int) -> tuple[TurnSample, str]:
    import openai

    t0 = time.perf_counter()
    first = None
    parts: list[str] = []
    sample = TurnSample(0, 0, True)
    try:
        stream = await open_stream(client.chat.completions.create, model, output_len, messages=messages)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                sample.prompt_tokens = chunk.usage.prompt_tokens
                sample.output_tokens = chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                sample.cached_tokens = details.cached_tokens if details is not None else None
    except openai.APIError as e:
        return TurnSample(0, 0, False, f"{type(e).__name__}: {e}"), ""
    sample.ttft = (first or time.perf_counter()) - t0
    return sample, "".join(parts)


async def _converse(
    client, model: str, user: int, conv: Conversation, output_len: int, gate
) -> list[TurnSample]:
    messages = [{"role": "system", "content": conv.system}]
    samples = []
    for turn, text in enumerate(conv.user_turns, 1):
        messages.append({"role": "user", "content": text})
        async with gate:
            sample, reply = await _chat_turn(client, model, messages, output_len)
        sample.user, sample.turn = user, turn
        samples.append(sample)
        if not sample.ok:
            break
        messages.append({"role": "assistant", "content": reply})
    return samples


async def run_conversations(
    url: str, model: str, convs: list[Conversation], load: MultiturnLoad, api_key: str | None = None
) -> list[TurnSample]:
    """All users at once, at most ``load.concurrency`` requests in flight; every turn's sample."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key or "none", max_retries=0, timeout=3600)
    gate = asyncio.Semaphore(load.concurrency)
    try:
        per_user = await asyncio.gather(
            *(_converse(client, model, u, c, load.output_len, gate) for u, c in enumerate(convs))
        )
    finally:
        await client.close()
    return [s for samples in per_user for s in samples]


def turn_rows(
    engine: str, kv: str, arm: str, load: MultiturnLoad, samples: list[TurnSample]
) -> list[TurnRow]:
    rows = []
    for turn in range(1, load.turns + 1):
        mine = [s for s in samples if s.turn == turn]
        ok = [s for s in mine if s.ok]
        ttft = np.array([s.ttft for s in ok]) if ok else np.array([np.nan])
        known = bool(ok) and all(s.cached_tokens is not None for s in ok)
        prompt = float(np.mean([s.prompt_tokens for s in ok])) if ok else float("nan")
        cached = float(np.mean([s.cached_tokens for s in ok])) if known else None
        row = TurnRow(
            engine, kv, arm, load.concurrency, turn, len(mine), len(mine) - len(ok),
            float(np.percentile(ttft, 50)), float(np.percentile(ttft, 90)), prompt, cached,
            prompt - cached if cached is not None else None,
        )  # fmt: skip
        rows.append(row)
    return rows


def counters_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """The prefix-cache and disk-tier counters gained during a run (None: the server has no such metric)."""
    return {m: after[m] - before.get(m, 0.0) if m in after else None for m in PREFIX_METRICS}


def counters_line(label: str, delta: dict[str, float | None]) -> str:
    def fmt(name: str) -> str:
        v = delta.get(name)
        return "n/a" if v is None else f"{v:.0f}"

    hit, prompt = delta.get(PREFIX_METRICS[0]), delta.get(PREFIX_METRICS[1])
    share = f"{hit / prompt:.0%}" if hit is not None and prompt else "n/a"
    return (
        f"[{label}] prefix hit tokens {fmt(PREFIX_METRICS[0])} of {fmt(PREFIX_METRICS[1])} prompt tokens "
        f"({share}); disk blocks spilled {fmt(PREFIX_METRICS[2])}, restored {fmt(PREFIX_METRICS[3])}"
    )


TURN_HEADERS = ["engine", "KV", "arm", "conc.", "turn", "requests", "failed", "TTFT p50 ms", "TTFT p90 ms",
                "prompt tok", "cached tok", "computed tok"]  # fmt: skip


def turn_table(rows: list[TurnRow]) -> list[list]:
    def tok(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.0f}"

    return [
        [r.engine, r.kv, r.arm, r.concurrency, r.turn, r.requests, r.failed, f"{1e3 * r.ttft_p50:.0f}",
         f"{1e3 * r.ttft_p90:.0f}", tok(r.prompt_tokens), tok(r.cached_tokens), tok(r.computed_tokens)]
        for r in rows
    ]  # fmt: skip


def followup_ttft(rows: list[TurnRow], engine: str, kv: str, arm: str, conc: int) -> float | None:
    """Median over the runs's turns >= 2 of their median TTFT (None: no such run)."""
    mine = [r.ttft_p50 for r in rows if (r.engine, r.kv, r.arm, r.concurrency) == (engine, kv, arm, conc)]
    return float(np.median(mine[1:])) if len(mine) > 1 else None


def ratio_lines(rows: list[TurnRow]) -> list[str]:
    """Turn >= 2 TTFT: cache / no-cache, disk / no-cache (recompute), small / no-cache, and
    llama-server / kvlens with its prefix cache, per KV mode and concurrency."""
    pairs = [
        (("kvlens", "cache"), ("kvlens", "no-cache"), "with prefix cache / without"),
        (("kvlens", "disk"), ("kvlens", "no-cache"), "disk tier / recompute"),
        (("kvlens", "small"), ("kvlens", "no-cache"), "small pool, no disk / recompute"),
        (("kvlens", "disk"), ("kvlens", "small"), "disk tier / small pool without it"),
        (("llama-server", "cache"), ("kvlens", "cache"), "llama-server / kvlens (both caching)"),
    ]
    keys = dict.fromkeys((r.kv, r.concurrency) for r in rows)
    lines = []
    for kv, conc in keys:
        for (ea, aa), (eb, ab), what in pairs:
            a, b = followup_ttft(rows, ea, kv, aa, conc), followup_ttft(rows, eb, kv, ab, conc)
            if a is not None and b:
                lines.append(f"{kv}, concurrency {conc}: turn >= 2 TTFT {what}: {a / b:.2f}x")
    return lines

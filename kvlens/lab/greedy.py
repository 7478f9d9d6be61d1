"""``kvlens lab greedy``: greedy continuations under the base and under each KV mode, side by side.

N prompts of ``prompt_len`` tokens are cut from the corpus at evenly spaced, non-overlapping offsets
(BOS first where the tokenizer adds one). Each prompt is prefilled in sub-chunks through a fresh
cache of the mode, then M tokens are decoded one at a time exactly as the engine generates (decode
steps read the mode's stored rows; for ``q8+mirror`` that is the int8 rows). Decoding is inherently
sequential; the prompt itself goes through the chunked prefill path.

Metrics per mode: token agreement rate (the fraction of the N×M generated positions where the mode's
token equals the base's), the first divergence position per prompt (M = identical), and the first
diverging continuations side by side.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..kv.cache import parse_mode
from .report import md_table, mode_label, model_name, parse_modes


def cut_prompts(ids: list[int], n: int, length: int, bos_id: int | None = None) -> list[list[int]]:
    """``n`` non-overlapping windows of ``length`` tokens, evenly spaced over ``ids``; with ``bos_id``
    each window is BOS + its first ``length - 1`` tokens."""
    if n < 1 or length < 2:
        raise ValueError(f"need at least 1 prompt of at least 2 tokens (got {n} × {length})")
    if len(ids) < n * length:
        raise ValueError(
            f"the corpus has {len(ids)} tokens; {n} prompts of {length} tokens need at least {n * length}"
        )
    stride = len(ids) // n
    prompts = [list(ids[i * stride : i * stride + length]) for i in range(n)]
    if bos_id is not None:
        prompts = [[bos_id, *p[: length - 1]] if p[0] != bos_id else p for p in prompts]
    return prompts


@torch.inference_mode()
def greedy_continuation(
    llm: Any, prompt: list[int], n_tokens: int, kv: str, prefill_chunk: int, **cache_options: Any
) -> list[int]:
    """``n_tokens`` greedy tokens (EOS does not stop: both sides always have n_tokens to compare)."""
    llm.check_fits(len(prompt) + n_tokens)
    cache = llm.new_cache(len(prompt) + n_tokens, kv, **cache_options)
    logits = llm.prefill(prompt, cache, prefill_chunk)
    out: list[int] = []
    pos = len(prompt)
    for i in range(n_tokens):
        tok = int(logits.argmax())
        out.append(tok)
        if i == n_tokens - 1:
            break
        logits = llm.model.logits(llm.forward([tok], cache, pos, prefill=False))[0]
        pos += 1
    return out


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (``len(a)`` if none)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


@dataclass
class GreedyMode:
    mode: str
    tokens: list[list[int]]
    agreement: float  # fraction of generated positions equal to the base's
    first_div: list[int]
    seconds: float

    @property
    def identical(self) -> int:
        n = len(self.tokens[0]) if self.tokens else 0
        return sum(d == n for d in self.first_div)


@dataclass
class GreedyResult:
    model: str
    corpus: str
    base: str
    n_prompts: int
    prompt_len: int
    n_tokens: int
    prefill_chunk: int
    keep_sink: int
    keep_recent: int
    prompts: list[list[int]]
    base_tokens: list[list[int]]
    base_seconds: float
    modes: list[GreedyMode]

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("modes", "prompts", "base_tokens")}
        d["modes"] = {
            m.mode: {
                "agreement": m.agreement,
                "identical_prompts": m.identical,
                "first_divergence": m.first_div,
                "first_divergence_median": float(np.median(m.first_div)),
                "tokens_per_s": self.n_prompts * self.n_tokens / m.seconds if m.seconds else None,
            }
            for m in self.modes
        }
        return d


def run_greedy(
    llm: Any,
    text: str,
    modes: list[str] | str = "q8",
    base: str = "f32",
    n_prompts: int = 16,
    prompt_len: int = 64,
    n_tokens: int = 32,
    prefill_chunk: int = 32,
    keep_sink: int = 0,
    keep_recent: int = 0,
    corpus_label: str = "",
    on_step: Any = None,
    sparse: Any = None,
) -> GreedyResult:
    modes = parse_modes(modes) if isinstance(modes, str) else list(modes)
    for m in (base, *modes):
        parse_mode(m)
    if n_tokens < 1:
        raise ValueError(f"--tokens must be at least 1 (got {n_tokens})")
    tok = llm.tokenizer
    bos = tok.bos_id if tok.add_bos and tok.bos_id is not None else None
    prompts = cut_prompts(tok.encode(text, add_bos=False), n_prompts, prompt_len, bos)
    keep = {"keep_sink": keep_sink, "keep_recent": keep_recent} if keep_sink or keep_recent else {}
    t0 = time.perf_counter()
    base_tokens = []
    for p in prompts:
        base_tokens.append(greedy_continuation(llm, p, n_tokens, base, prefill_chunk))
        if on_step:
            on_step(base)
    base_s = time.perf_counter() - t0
    # test modes with sparse decode (kvlens.kv.blocks.SparseConfig); the base stays dense
    test_llm = llm if sparse is None else llm.variant(sparse=sparse)
    results = []
    for m in modes:
        opts = {} if m == base and not keep else {"mirror_prefill": "exact", **keep}
        t0 = time.perf_counter()
        toks = []
        for p in prompts:
            toks.append(greedy_continuation(test_llm, p, n_tokens, m, prefill_chunk, **opts))
            if on_step:
                on_step(m)
        secs = time.perf_counter() - t0
        same = sum(x == y for a, b in zip(toks, base_tokens, strict=True) for x, y in zip(a, b, strict=True))
        divs = [first_divergence(b, a) for a, b in zip(toks, base_tokens, strict=True)]
        results.append(GreedyMode(m, toks, same / (len(prompts) * n_tokens), divs, secs))
    return GreedyResult(
        model_name(llm), corpus_label, base, len(prompts), prompt_len, n_tokens, prefill_chunk,
        keep_sink, keep_recent, prompts, base_tokens, base_s, results,
    )  # fmt: skip


# -- output ------------------------------------------------------------------------------------------
def _show(s: str, width: int = 70) -> str:
    s = s.replace("\n", "⏎")
    return s if len(s) <= width else s[: width - 1] + "…"


def summary_rows(r: GreedyResult) -> tuple[list[str], list[list[str]]]:
    headers = ["mode", "stores", "token agreement", "identical prompts", "first div. median", "min", "tok/s"]
    rows = []
    for m in r.modes:
        tps = r.n_prompts * r.n_tokens / m.seconds if m.seconds else float("nan")
        rows.append(
            [
                m.mode,
                mode_label(m.mode),
                f"{100 * m.agreement:.1f}%",
                f"{m.identical}/{r.n_prompts}",
                f"{np.median(m.first_div):.1f}",
                min(m.first_div),
                f"{tps:.1f}",
            ]
        )
    return headers, rows


def divergences(r: GreedyResult, tokenizer: Any, show: int = 3) -> list[str]:
    """For each mode, the first ``show`` diverging prompts: shared text, then base vs mode from there."""
    lines = []
    for m in r.modes:
        shown = 0
        for i, d in enumerate(m.first_div):
            if d == r.n_tokens or shown >= show:
                continue
            shown += 1
            b, q = r.base_tokens[i], m.tokens[i]
            lines += [
                f"[{m.mode}] prompt {i}, first divergence at generated token {d}",
                f"  prompt …  {_show(tokenizer.decode(r.prompts[i][-16:]))}",
                f"  shared    {_show(tokenizer.decode(b[:d]))}",
                f"  {r.base:<9} {_show(tokenizer.decode(b[d:]))}",
                f"  {m.mode:<9} {_show(tokenizer.decode(q[d:]))}",
            ]
        if shown == 0:
            lines.append(f"[{m.mode}] no prompt diverged")
    return lines


def describe(r: GreedyResult) -> list[str]:
    lines = [
        f"model {r.model}; corpus {r.corpus}; {r.n_prompts} prompts × {r.prompt_len} tokens cut from it",
        f"{r.n_tokens} greedy tokens under base {r.base} and each mode; prompt prefilled in sub-chunks "
        f"of {r.prefill_chunk}, then one decode step per token through the mode's cache",
    ]
    if r.keep_sink or r.keep_recent:
        lines.append(f"kept exact in test modes: first {r.keep_sink} / last {r.keep_recent} positions")
    return lines


def write_report(r: GreedyResult, tokenizer: Any, out_dir: str | Path, command: str = "") -> Path:
    from .report import plot_divergence, write_markdown

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    plot_divergence({m.mode: m.first_div for m in r.modes}, r.n_tokens, d / "greedy_divergence.png")
    headers, rows = summary_rows(r)
    md = ["# kvlens lab greedy", ""] + (["```", command, "```", ""] if command else [])
    md += [f"- {line}" for line in describe(r)] + [""]
    md += [md_table(headers, rows), "![first divergence positions](greedy_divergence.png)", ""]
    md += ["## First diverging continuations", "", "```", *divergences(r, tokenizer), "```", ""]
    return write_markdown(d, "greedy.md", "\n".join(md))


def cli(
    model: str,
    corpus: str | None,
    prompt_len: int,
    kv: str,
    base: str,
    n_prompts: int,
    n_tokens: int,
    prefill_chunk: int,
    keep_sink: int,
    keep_recent: int,
    show: int,
    json_out: bool,
    report: str | Path | None,
    sparse: Any = None,
) -> None:
    """The body of ``kvlens lab greedy``."""
    import sys

    from .report import dump_json, load_lab, print_table, progress

    modes = parse_modes(kv)
    llm, text, label = load_lab(model, corpus, base)
    with progress(n_prompts * (1 + len(modes)), "lab greedy") as step:
        r = run_greedy(
            llm, text, modes, base, n_prompts, prompt_len, n_tokens, prefill_chunk, keep_sink, keep_recent,
            label, step, sparse,
        )  # fmt: skip
    if json_out:
        print(dump_json(r.to_json()))
    else:
        print("\n".join(describe(r)))
        if sparse is not None:
            print(
                f"test modes decode with sparse attention: {sparse.method}, budget {sparse.budget:g}, "
                f"first {sparse.dense_layers} layers dense; base {r.base} dense"
            )
        headers, rows = summary_rows(r)
        print_table(f"Greedy agreement with {r.base}", headers, rows)
        print("\n".join(divergences(r, llm.tokenizer, show)))
        print(f"base: {r.n_prompts * r.n_tokens / r.base_seconds:.1f} tok/s")
    if report is not None:
        path = write_report(r, llm.tokenizer, report, "kvlens " + " ".join(sys.argv[1:]))
        print(f"report: {path}", file=sys.stderr)

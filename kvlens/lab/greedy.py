"""``kvlens lab greedy``: greedy continuations under the base and under each KV mode, side by side.

N prompts of ``prompt_len`` tokens are cut from the corpus at evenly spaced, non-overlapping offsets
(BOS first where the tokenizer adds one). Each prompt is prefilled in sub-chunks through a fresh
cache of the mode, then M tokens are decoded one at a time exactly as the engine generates (decode
steps read the mode's stored rows; for ``q8+mirror`` that is the int8 rows). Decoding is inherently
sequential; the prompt itself goes through the chunked prefill path.

Metrics per mode: token agreement rate (the fraction of the N×M generated positions where the mode's
token equals the base's), the first divergence position per prompt (M = identical), and the first
diverging continuations side by side.

Weights: the base and every mode run on one model, so a mode is compared with a base with the same
weights (the KV cost alone). With a second, f32-weights model (``ref_llm``), each prompt is also
continued once with f32 weights and an f32 cache (the reference), and the base (the weights' cost
alone when the base is f32) and each mode (weights and KV combined) are compared with it too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..checks import check_counts
from ..engine.llm import LLM
from ..kv.blocks import SparseConfig
from ..kv.modes import CacheOptions, KVMode
from ..report import CommandOutput, md_table, print_table, run_command, write_markdown
from .common import (
    REF_KV,
    VS_F32_TITLE,
    CompareConfig,
    header_notes,
    load_compare,
    model_name,
    plot_divergence,
    vs_f32_json,
    weights_label,
)


@dataclass
class GreedyConfig(CompareConfig):
    """``kvlens lab greedy``: ``prompts`` prompts of ``ctx`` tokens, ``tokens`` greedy tokens each;
    ``show`` diverging continuations printed per mode."""

    ctx: int = 64
    prompts: int = 16
    tokens: int = 32
    show: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        check_counts(self, "prompts")
        check_counts(self, "ctx", minimum=2)  # a prompt token and the one it predicts
        check_counts(self, "show", minimum=0)
        check_counts(self, "tokens", minimum=None)  # an int (the range is said below)
        if self.tokens < 1:
            raise ValueError(f"--tokens must be at least 1 (got {self.tokens})")


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


def greedy_continuation(
    llm: LLM,
    prompt: list[int],
    n_tokens: int,
    kv: str | KVMode,
    prefill_chunk: int,
    options: CacheOptions | None = None,
) -> list[int]:
    """``n_tokens`` greedy tokens from the engine's generation loop through a fresh ``kv`` cache (EOS
    does not stop: both sides always have n_tokens to compare)."""
    cache = llm.new_cache(len(prompt) + n_tokens, kv, options)
    return list(
        llm.generate_ids(prompt, n_tokens, stop_at_eos=False, cache=cache, prefill_chunk=prefill_chunk)
    )


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (``len(a)`` if none)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


@dataclass
class GreedyMode:
    mode: KVMode
    tokens: list[list[int]]
    agreement: float  # fraction of generated positions equal to the base's
    first_div: list[int]
    seconds: float

    @property
    def identical(self) -> int:
        n = len(self.tokens[0]) if self.tokens else 0
        return sum(d == n for d in self.first_div)

    def to_json(self, n_tokens: int) -> dict[str, Any]:
        return {
            "agreement": self.agreement,
            "identical_prompts": self.identical,
            "first_divergence": self.first_div,
            "first_divergence_median": float(np.median(self.first_div)),
            "tokens_per_s": len(self.tokens) * n_tokens / self.seconds if self.seconds else None,
        }


def compare(mode: KVMode, tokens: list[list[int]], ref: list[list[int]], seconds: float) -> GreedyMode:
    """``tokens`` (one continuation per prompt) against ``ref``'s: agreement and first divergences."""
    same = sum(x == y for a, b in zip(tokens, ref, strict=True) for x, y in zip(a, b, strict=True))
    divs = [first_divergence(b, a) for a, b in zip(tokens, ref, strict=True)]
    return GreedyMode(mode, tokens, same / sum(len(b) for b in ref), divs, seconds)


@dataclass
class GreedyResult:
    model: str
    corpus: str
    base: KVMode
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
    weights: str = "f32"  # the weights of the base and every mode (``llm.weights_mode``)
    ref_tokens: list[list[int]] = field(default_factory=list)  # f32 weights + f32 KV ([]: no reference)
    ref_seconds: float = 0.0
    # vs the reference: the base first, then each mode not equal to the base
    vs_f32_weights: list[GreedyMode] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        skip = ("modes", "prompts", "base_tokens", "ref_tokens", "vs_f32_weights")
        d = {k: v for k, v in self.__dict__.items() if k not in skip}
        d["base"] = self.base.name
        d["modes"] = {m.mode.name: m.to_json(self.n_tokens) for m in self.modes}
        d["vs_f32_weights"] = vs_f32_json(self, lambda m: m.to_json(self.n_tokens))
        return d


def _continue_all(
    llm: LLM,
    prompts: list[list[int]],
    mode: KVMode,
    cfg: GreedyConfig,
    options: CacheOptions | None,
    step: Callable[[str], None],
    label: str,
) -> tuple[list[list[int]], float]:
    """Every prompt's greedy continuation under ``mode``, and the seconds they took."""
    t0, out = time.perf_counter(), []
    for p in prompts:
        out.append(greedy_continuation(llm, p, cfg.tokens, mode, cfg.prefill_chunk, options))
        step(label)
    return out, time.perf_counter() - t0


def run_greedy(
    llm: LLM,
    text: str,
    cfg: GreedyConfig,
    corpus_label: str = "",
    on_step: Callable[[str], None] | None = None,
    ref_llm: LLM | None = None,
) -> GreedyResult:
    """Greedy continuations of prompts cut from ``text`` under ``cfg.base`` and each mode; with
    ``ref_llm`` (the model with f32 weights, ``llm`` having others) also under f32 weights + f32 KV,
    compared with the base and each mode into ``vs_f32_weights``."""
    step = on_step or (lambda _label: None)
    tok = llm.tokenizer
    bos = tok.bos_prefix[0] if tok.bos_prefix else None
    prompts = cut_prompts(tok.encode(text, add_bos=False), cfg.prompts, cfg.ctx, bos)
    base, base_s = _continue_all(llm, prompts, cfg.base, cfg, None, step, str(cfg.base))
    ref, ref_s = [], 0.0
    if ref_llm is not None:
        ref, ref_s = _continue_all(ref_llm, prompts, REF_KV, cfg, None, step, "f32 weights")
    # test modes with sparse decode (kvlens.kv.blocks.SparseConfig); the base stays dense
    test_llm = llm if cfg.sparse is None else llm.variant(sparse=cfg.sparse)
    results, vs_ref = [], [compare(cfg.base, base, ref, base_s)] if ref else []
    for m in cfg.kv:
        options = None if cfg.same_as_base(m) else cfg.cache_options
        toks, secs = _continue_all(test_llm, prompts, m, cfg, options, step, str(m))
        results.append(compare(m, toks, base, secs))
        if ref and m != cfg.base:  # a mode named like the base: its combined cost is the base row's
            vs_ref.append(compare(m, toks, ref, secs))
    return GreedyResult(
        model_name(llm), corpus_label, cfg.base, len(prompts), cfg.ctx, cfg.tokens, cfg.prefill_chunk,
        cfg.keep_sink, cfg.keep_recent, prompts, base, base_s, results,
        getattr(llm, "weights_mode", "f32"), ref, ref_s, vs_ref,
    )  # fmt: skip


# -- output ------------------------------------------------------------------------------------------
def _show(s: str, width: int = 70) -> str:
    s = s.replace("\n", "⏎")
    return s if len(s) <= width else s[: width - 1] + "…"


def summary_rows(r: GreedyResult, vs_f32_weights: bool = False) -> tuple[list[str], list[list[str]]]:
    """The modes vs the base (same weights), or with ``vs_f32_weights`` the base and every mode vs the
    reference (f32 weights + f32 KV)."""
    first = "weights · KV" if vs_f32_weights else "mode"
    headers = [first, "stores", "token agreement", "identical prompts", "first div. median", "min", "tok/s"]
    rows = []
    for m in r.vs_f32_weights if vs_f32_weights else r.modes:
        tps = r.n_prompts * r.n_tokens / m.seconds if m.seconds else float("nan")
        rows.append(
            [
                weights_label(r, m, short=True) if vs_f32_weights else m.mode.name,
                m.mode.label,
                f"{100 * m.agreement:.1f}%",
                f"{m.identical}/{r.n_prompts}",
                f"{np.median(m.first_div):.1f}",
                min(m.first_div),
                f"{tps:.1f}",
            ]
        )
    return headers, rows


def divergences(r: GreedyResult, tokenizer: Any, show: int = 3, vs_f32_weights: bool = False) -> list[str]:
    """For each mode, the first ``show`` diverging prompts: shared text, then base vs mode from there
    (with ``vs_f32_weights``: the reference vs each row of that table)."""
    rows, ref, ref_name = r.modes, r.base_tokens, r.base
    if vs_f32_weights:
        rows, ref, ref_name = r.vs_f32_weights, r.ref_tokens, "f32·f32"
    lines = []
    for m in rows:
        name = f"{r.weights}·{m.mode}" if vs_f32_weights else m.mode
        shown = 0
        for i, d in enumerate(m.first_div):
            if d == r.n_tokens or shown >= show:
                continue
            shown += 1
            b, q = ref[i], m.tokens[i]
            lines += [
                f"[{name}] prompt {i}, first divergence at generated token {d}",
                f"  prompt …  {_show(tokenizer.decode(r.prompts[i][-16:]))}",
                f"  shared    {_show(tokenizer.decode(b[:d]))}",
                f"  {ref_name:<9} {_show(tokenizer.decode(b[d:]))}",
                f"  {name:<9} {_show(tokenizer.decode(q[d:]))}",
            ]
        if shown == 0:
            lines.append(f"[{name}] no prompt diverged")
    return lines


def describe(r: GreedyResult) -> list[str]:
    lines = [
        f"model {r.model}; corpus {r.corpus}; {r.n_prompts} prompts × {r.prompt_len} tokens cut from it",
        f"{r.n_tokens} greedy tokens under base {r.base} and each mode; prompt prefilled in sub-chunks "
        f"of {r.prefill_chunk}, then one decode step per token through the mode's cache",
    ]
    return lines + header_notes(r, "agreement is with")


def titles(r: GreedyResult) -> tuple[str, str]:
    w = f", weights {r.weights}" if r.vs_f32_weights else ""
    return f"Greedy agreement with {r.base}{w}", f"Greedy agreement, {VS_F32_TITLE}: weights {r.weights}"


def write_report(r: GreedyResult, tokenizer: Any, out_dir: str | Path, command: str = "") -> Path:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    plot_divergence({m.mode.name: m.first_div for m in r.modes}, r.n_tokens, d / "greedy_divergence.png")
    headers, rows = summary_rows(r)
    md = ["# kvlens lab greedy", ""] + (["```", command, "```", ""] if command else [])
    md += [f"- {line}" for line in describe(r)] + [""]
    md += [f"**{titles(r)[0]}**", ""] if r.vs_f32_weights else []
    md += [md_table(headers, rows), "![first divergence positions](greedy_divergence.png)", ""]
    md += ["## First diverging continuations", "", "```", *divergences(r, tokenizer), "```", ""]
    if r.vs_f32_weights:
        md += [f"## {titles(r)[1]}", "", md_table(*summary_rows(r, True))]
        md += ["First diverging continuations:", "", "```", *divergences(r, tokenizer, 3, True), "```", ""]
    return write_markdown(d, "greedy.md", "\n".join(md))


def render(r: GreedyResult, tokenizer: Any, show: int, sparse: SparseConfig | None) -> None:
    """The terminal output: the protocol, the tables and the first diverging continuations."""
    print("\n".join(describe(r)))
    if sparse is not None:
        print(
            f"test modes decode with sparse attention: {sparse.method}, budget {sparse.budget:g}, "
            f"first {sparse.dense_layers} layers dense; base {r.base} dense"
        )
    print_table(titles(r)[0], *summary_rows(r))
    print("\n".join(divergences(r, tokenizer, show)))
    if r.vs_f32_weights:
        print_table(titles(r)[1], *summary_rows(r, True))
        print("\n".join(divergences(r, tokenizer, show, True)))
    print(f"base: {r.n_prompts * r.n_tokens / r.base_seconds:.1f} tok/s")
    if r.ref_seconds:
        print(f"reference (f32 weights, f32 KV): {r.n_prompts * r.n_tokens / r.ref_seconds:.1f} tok/s")


def main(cfg: GreedyConfig, json_out: bool = False, report: str | Path | None = None) -> GreedyResult:
    """The body of ``kvlens lab greedy``."""
    llm, ref, text, label = load_compare(cfg)
    output = CommandOutput(
        lambda r: render(r, llm.tokenizer, cfg.show, cfg.sparse),
        GreedyResult.to_json,
        lambda r, out_dir, command: write_report(r, llm.tokenizer, out_dir, command),
    )
    steps = cfg.prompts * (1 + len(cfg.kv) + (ref is not None))
    return run_command(
        "lab greedy",
        steps,
        lambda step: run_greedy(llm, text, cfg, label, step, ref),
        output,
        json_out,
        report,
    )

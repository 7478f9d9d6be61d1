"""``kvlens lab ppl``: llama-perplexity's protocol and its ``--kl-divergence`` report, per KV-cache mode.

Protocol (llama.cpp ``llama-perplexity``): the whole text is tokenized once (BOS first where the
tokenizer adds one); it is cut into non-overlapping chunks of ``ctx`` tokens (a partial tail is
dropped); each chunk's first token is replaced by BOS where the tokenizer adds one; each chunk is
evaluated from an empty cache; only the second half is scored: the logits of positions
``ctx//2 .. ctx-2`` predict tokens ``ctx//2+1 .. ctx-1`` (``ctx - 1 - ctx//2`` tokens per chunk).

The baseline (``base``, default f32) is computed in the same run. Test modes prefill each chunk in
sub-chunks of ``prefill_chunk`` tokens, so every sub-chunk attends all earlier positions through the
mode's (quantized) cache. (kvlens's cache also writes the current sub-chunk before attending it, so a
query reads int8 for its own sub-chunk too: the sub-chunk size changes a q8 result only through float
rounding that flips int8 rounding decisions.) An f32 base is prefilled in one pass (f32 storage is
chunk-invariant); any other base uses the same sub-chunks as the test modes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..kv.cache import parse_mode
from .report import MIRROR_MODE, md_table, mode_label, model_name, parse_modes
from .stats import format_kld_report, summarize

MIRROR_NOTE = (
    "measures nothing about prefill: every prefill sub-chunk reads the exact f32 mirror, never the "
    "int8 rows (the seed engine's behaviour), so this perplexity cannot see q8"
)
_METRIC_KEYS = ("nll_q", "nll_base", "kld", "top_q", "top_base")


def make_chunks(
    ids: list[int], ctx: int, n_chunks: int | None = None, bos_id: int | None = None
) -> list[list[int]]:
    """Non-overlapping ``ctx``-token chunks of ``ids``; the first token of each becomes ``bos_id`` if given.

    At most ``n_chunks`` (llama.cpp silently caps a larger request at the number available).
    """
    if ctx < 4:
        raise ValueError(f"ctx must be at least 4 tokens (got {ctx}): half of it is context, half is scored")
    if n_chunks is not None and n_chunks < 1:
        raise ValueError(f"--chunks must be at least 1 (got {n_chunks})")
    available = len(ids) // ctx
    if available < 1:
        raise ValueError(
            f"the corpus has {len(ids)} tokens; ctx {ctx} needs at least {ctx} tokens (one chunk)"
        )
    n = available if n_chunks is None else min(n_chunks, available)
    chunks = [list(ids[i * ctx : (i + 1) * ctx]) for i in range(n)]
    if bos_id is not None:
        for c in chunks:
            c[0] = bos_id  # llama-perplexity overwrites (not inserts) the first token of every chunk
    return chunks


def scored_span(ctx: int) -> tuple[int, int]:
    """``(first, end)``: the logits of positions ``first .. end-1`` are scored (against token ``pos+1``)."""
    return ctx // 2, ctx - 1


@torch.inference_mode()
def scored_logits(
    llm: Any, chunk: list[int], kv: str, prefill_chunk: int, first: int, **cache_options: Any
) -> torch.Tensor:
    """Logits [len(chunk)-1-first, vocab] of the scored positions, the chunk prefilled through a fresh
    ``kv`` cache in sub-chunks of ``prefill_chunk``; the LM head runs on the scored rows only.

    With sparse decode (``llm.sparse``), only the prefix up to ``first`` is prefilled; the scored
    positions are then run one decode step each (teacher-forced), since sparse attention is a decode
    path: that is what a sparse engine would compute for them."""
    cache = llm.new_cache(len(chunk), kv, **cache_options)
    end = len(chunk) - 1
    kept: list[torch.Tensor] = []
    if getattr(llm, "sparse", None) is not None:
        llm.prefill(
            chunk[: first + 1],
            cache,
            prefill_chunk,
            on_hidden=lambda s, h: kept.append(h[first - s :]) if s + h.shape[0] > first else None,
        )
        for pos in range(first + 1, end):
            kept.append(llm.forward([chunk[pos]], cache, pos, prefill=False))
        return llm.model.logits(torch.cat(kept))

    def keep(start: int, hidden: torch.Tensor) -> None:
        lo, hi = max(first - start, 0), min(end - start, hidden.shape[0])
        if hi > lo:
            kept.append(hidden[lo:hi])

    llm.prefill(chunk, cache, prefill_chunk, on_hidden=keep)
    return llm.model.logits(torch.cat(kept))


class BaseLogProbs:
    """A chunk's base log-probabilities in float64, computed once and shared by every mode."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
        self.p = self.logp.exp()
        self.top = logits.argmax(dim=-1)


def chunk_metrics(
    base: BaseLogProbs, logits_q: torch.Tensor, targets: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-token nll_q, nll_base, kld, top_q, top_base (as ``stats.token_metrics``, ~5x faster: the base
    log-softmax is shared and KL(base || q) is one fused product-sum; finite logits never give 0 * inf)."""
    lq = torch.log_softmax(logits_q.to(torch.float64), dim=-1)
    idx = targets.to(torch.long).reshape(-1, 1)
    return {
        "nll_q": -lq.gather(-1, idx).squeeze(-1),
        "nll_base": -base.logp.gather(-1, idx).squeeze(-1),
        "kld": torch.einsum("ij,ij->i", base.p, base.logp - lq),
        "top_q": logits_q.argmax(dim=-1),
        "top_base": base.top,
    }


@dataclass
class ModeResult:
    mode: str
    stats: dict[str, float]
    bytes_per_token: int
    seconds: float  # forward time (cache + model + LM head), not the statistics
    tokens: int  # tokens run through the model
    prefill_chunk: int
    kld: np.ndarray = field(repr=False)
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    def to_json(self) -> dict[str, Any]:
        s = self.stats
        head = {
            "ppl": s["ppl_q"],
            "ppl_base": s["ppl_base"],
            "ppl_ratio": s["ppl_ratio"],
            "kld_mean": s["kld_mean"],
            "kld_p99": s["kld_p99"],
            "same_top_p": s["same_top_p"],
            "tokens_scored": s["n_tokens"],
        }
        extra = {
            "bytes_per_token": self.bytes_per_token,
            "prefill_chunk": self.prefill_chunk,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens_per_s,
        }
        return head | extra | {"note": self.note} | {"stats": s}


@dataclass
class PplResult:
    model: str
    corpus: str
    ctx: int
    chunks: int
    chunks_available: int
    corpus_tokens: int
    bos_id: int | None
    base: str
    base_prefill_chunk: int
    prefill_chunk: int
    keep_sink: int
    keep_recent: int
    base_seconds: float
    base_bytes_per_token: int
    wall_seconds: float
    modes: list[ModeResult]

    @property
    def tokens_scored(self) -> int:
        first, end = scored_span(self.ctx)
        return self.chunks * (end - first)

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "modes"}
        d["tokens_scored"] = self.tokens_scored
        d["base_tokens_per_s"] = self.chunks * self.ctx / self.base_seconds if self.base_seconds else None
        d["modes"] = {m.mode: m.to_json() for m in self.modes}
        return d


def run_ppl(
    llm: Any,
    text: str,
    ctx: int = 512,
    modes: list[str] | str = "q8",
    base: str = "f32",
    n_chunks: int | None = None,
    prefill_chunk: int = 32,
    keep_sink: int = 0,
    keep_recent: int = 0,
    corpus_label: str = "",
    on_step: Any = None,
    sparse: Any = None,
) -> PplResult:
    """Score ``text`` under ``base`` and every mode of ``modes`` (one model, chunk-outer loop so each
    chunk's base logits are computed once). ``on_step(label)`` is called after every forward."""
    t_wall = time.perf_counter()
    modes = parse_modes(modes) if isinstance(modes, str) else list(modes)
    for m in (base, *modes):
        parse_mode(m)
    if prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be at least 1 (got {prefill_chunk})")
    if keep_sink < 0 or keep_recent < 0:
        raise ValueError("--keep-sink / --keep-recent must be >= 0")
    tok = llm.tokenizer
    bos = tok.bos_id if tok.add_bos and tok.bos_id is not None else None
    ids = tok.encode(text)  # whole text at once; BOS first where the tokenizer adds one
    chunks = make_chunks(ids, ctx, n_chunks, bos)
    llm.check_fits(ctx)
    first, _ = scored_span(ctx)
    base_pc = ctx if base == "f32" else prefill_chunk
    keep = {"keep_sink": keep_sink, "keep_recent": keep_recent} if keep_sink or keep_recent else {}

    def plan(m: str) -> tuple[int, dict[str, Any]]:
        # A mode equal to the base runs the base's exact path: KLD is then exactly 0 (determinism check).
        if m == base and not keep:
            return base_pc, {}
        return prefill_chunk, {"mirror_prefill": "exact", **keep}

    # test modes with sparse decode (kvlens.kv.blocks.SparseConfig); the base stays dense
    test_llm = llm if sparse is None else llm.variant(sparse=sparse)
    acc = {m: {k: [] for k in _METRIC_KEYS} for m in modes}
    secs = dict.fromkeys(modes, 0.0)
    base_secs = 0.0
    for chunk in chunks:
        targets = torch.tensor(chunk[first + 1 :], dtype=torch.long)
        t0 = time.perf_counter()
        base_logits = scored_logits(llm, chunk, base, base_pc, first)
        base_secs += time.perf_counter() - t0
        lb = BaseLogProbs(base_logits)
        if on_step:
            on_step(base)
        for m in modes:
            pc, opts = plan(m)
            t0 = time.perf_counter()
            lq = scored_logits(test_llm, chunk, m, pc, first, **opts)
            secs[m] += time.perf_counter() - t0
            for k, v in chunk_metrics(lb, lq, targets).items():
                acc[m][k].append(v.cpu().numpy())
            if on_step:
                on_step(m)

    results = []
    for m in modes:
        a = {k: np.concatenate(v) for k, v in acc[m].items()}
        stats = summarize(a["nll_q"], a["nll_base"], a["kld"], a["top_q"], a["top_base"])
        note = MIRROR_NOTE if m == MIRROR_MODE else ""
        if m == base and not keep:
            note = "same path as the base (determinism check)"
        bpt = llm.new_cache(1, m).bytes_per_token()
        if sparse is not None:
            note = (
                f"sparse decode: {sparse.method}, budget {sparse.budget:g}, first {sparse.dense_layers} layers "
                f"dense, scored positions run as decode steps"
            )
        results.append(ModeResult(m, stats, bpt, secs[m], len(chunks) * ctx, plan(m)[0], a["kld"], note))
    return PplResult(
        model=model_name(llm),
        corpus=corpus_label,
        ctx=ctx,
        chunks=len(chunks),
        chunks_available=len(ids) // ctx,
        corpus_tokens=len(ids),
        bos_id=bos,
        base=base,
        base_prefill_chunk=base_pc,
        prefill_chunk=prefill_chunk,
        keep_sink=keep_sink,
        keep_recent=keep_recent,
        base_seconds=base_secs,
        base_bytes_per_token=llm.new_cache(1, base).bytes_per_token(),
        wall_seconds=time.perf_counter() - t_wall,
        modes=results,
    )


# -- output ------------------------------------------------------------------------------------------
def describe(r: PplResult) -> list[str]:
    """The protocol in words (for the terminal and the Markdown report)."""
    first, end = scored_span(r.ctx)
    bos = (
        f"first token of every chunk replaced by BOS (id {r.bos_id})"
        if r.bos_id is not None
        else ("no BOS (the tokenizer adds none)")
    )
    base_how = (
        "prefilled in one pass (f32 storage is chunk-invariant)"
        if r.base_prefill_chunk == r.ctx
        else f"prefilled in sub-chunks of {r.base_prefill_chunk} tokens, like the test modes"
    )
    lines = [
        f"model {r.model}; corpus {r.corpus}: {r.corpus_tokens} tokens",
        f"ctx {r.ctx}: {r.chunks} of {r.chunks_available} chunks, {bos}",
        f"scored: second half of each chunk, positions {first}..{end - 1} predict tokens {first + 1}..{end} "
        f"-> {end - first} per chunk, {r.tokens_scored} in total",
        f"base {r.base}: {base_how}",
        f"test modes: prefill sub-chunk {r.prefill_chunk} tokens; each sub-chunk is written to the mode's "
        "cache, then attends every position up to its own through it (its own rows included)",
    ]
    if r.keep_sink or r.keep_recent:
        lines.append(f"kept exact in test modes: first {r.keep_sink} / last {r.keep_recent} positions")
    return lines


def summary_rows(r: PplResult) -> tuple[list[str], list[list[str]]]:
    headers = ["mode", "KV B/token", "PPL", "ΔPPL", "PPL ratio", "KLD mean", "KLD 99%", "same top p", "tok/s"]
    base_tps = r.chunks * r.ctx / r.base_seconds if r.base_seconds else float("nan")
    rows = [[f"{r.base} (base)", r.base_bytes_per_token, f"{r.modes[0].stats['ppl_base']:.4f}" if r.modes else "",
             "", "", "", "", "", f"{base_tps:.0f}"]]  # fmt: skip
    for m in r.modes:
        s = m.stats
        rows.append(
            [
                m.mode + (" *" if m.mode == MIRROR_MODE else ""),
                m.bytes_per_token,
                f"{s['ppl_q']:.4f}",
                f"{s['ppl_diff']:+.5f} ± {s['ppl_diff_err']:.5f}",
                f"{s['ppl_ratio']:.5f}",
                f"{s['kld_mean']:.3e} ± {s['kld_mean_err']:.1e}",
                f"{s['kld_p99']:.3e}",
                f"{s['same_top_p']:.2f}%",
                f"{m.tokens_per_s:.0f}",
            ]
        )
    return headers, rows


def mode_header(r: PplResult, m: ModeResult) -> str:
    return (
        f"=== {m.mode} ({mode_label(m.mode)}; {m.bytes_per_token} KV bytes/token; prefill sub-chunk "
        f"{m.prefill_chunk}; base {r.base}) ==="
    )


def format_text(r: PplResult) -> str:
    out = [*describe(r), ""]
    for m in r.modes:
        out.append(mode_header(r, m))
        if m.note:
            out.append(f"NOTE: {m.mode} {m.note}")
        out.append(format_kld_report(m.stats))
    return "\n".join(out)


def write_report(r: PplResult, out_dir: str | Path, command: str = "") -> Path:
    from .report import plot_kld, write_markdown

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    plot_kld({m.mode: m.kld for m in r.modes}, d / "ppl_kld.png")
    headers, rows = summary_rows(r)
    md = ["# kvlens lab ppl", ""]
    if command:
        md += ["```", command, "```", ""]
    md += [f"- {line}" for line in describe(r)] + [f"- wall time {r.wall_seconds:.1f} s", ""]
    md += [md_table(headers, rows), "![KLD distribution per mode](ppl_kld.png)", ""]
    for m in r.modes:
        md += [f"## {m.mode}", ""]
        if m.note:
            md += [f"**{m.mode} {m.note}.**", ""]
        md += ["```", mode_header(r, m), format_kld_report(m.stats), "```", ""]
    return write_markdown(d, "ppl.md", "\n".join(md))


def cli(
    model: str,
    corpus: str | None,
    ctx: int,
    kv: str,
    base: str,
    chunks: int | None,
    prefill_chunk: int,
    keep_sink: int,
    keep_recent: int,
    json_out: bool,
    report: str | Path | None,
    sparse: Any = None,
) -> None:
    """The body of ``kvlens lab ppl``."""
    import sys

    from .report import dump_json, load_lab, print_table, progress

    modes = parse_modes(kv)
    llm, text, label = load_lab(model, corpus, base)
    ids_est = len(llm.tokenizer.encode(text)) // max(ctx, 1)
    n = min(chunks or ids_est, ids_est) or 1
    with progress(n * (1 + len(modes)), "lab ppl") as step:
        r = run_ppl(
            llm, text, ctx, modes, base, chunks, prefill_chunk, keep_sink, keep_recent, label, step, sparse
        )
    if json_out:
        print(dump_json(r.to_json()))
    else:
        print(format_text(r))
        headers, rows = summary_rows(r)
        print_table(f"KV modes vs {r.base} ({r.tokens_scored} tokens scored)", headers, rows)
        if any(m.mode == MIRROR_MODE for m in r.modes):
            print(f"* {MIRROR_MODE} {MIRROR_NOTE}")
        print(f"wall time {r.wall_seconds:.1f} s")
    if report is not None:
        path = write_report(r, report, "kvlens " + " ".join(sys.argv[1:]))
        print(f"report: {path}", file=sys.stderr)

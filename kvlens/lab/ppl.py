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

Weights: the base and every mode run on one model (``llm``), so a mode's cost is measured against a
base with the same weights (the KV cost alone). With a second, f32-weights model (``ref_llm``), every
chunk is also run once through it with an f32 cache (the reference, one pass) and two more kinds of
row are scored against it: the base (the weights' cost alone when the base is f32) and each mode
(weights and KV combined). The terminal, JSON and Markdown output is in :mod:`.ppl_report`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..engine.llm import LLM
from ..kv.modes import MODES, CacheOptions, KVMode
from .report import model_name, parse_modes
from .stats import summarize

MIRROR_NOTE = (
    "measures nothing about prefill: every prefill sub-chunk reads the exact f32 mirror, never the "
    "int8 rows (the seed engine's behaviour), so this perplexity cannot see q8"
)
_METRIC_KEYS = ("nll_q", "nll_base", "kld", "top_q", "top_base")
REF_KV = MODES["f32"]  # the reference's KV mode (with f32 weights)


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
    llm: LLM,
    chunk: list[int],
    kv: KVMode,
    prefill_chunk: int,
    first: int,
    options: CacheOptions | None = None,
) -> torch.Tensor:
    """Logits [len(chunk)-1-first, vocab] of the scored positions, the chunk prefilled through a fresh
    ``kv`` cache in sub-chunks of ``prefill_chunk``; the LM head runs on the scored rows only.

    With sparse decode (``llm.sparse``), only the prefix up to ``first`` is prefilled; the scored
    positions are then run one decode step each (teacher-forced), since sparse attention is a decode
    path: that is what a sparse engine would compute for them."""
    cache = llm.new_cache(len(chunk), kv, options)
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
        return llm.lm_head(torch.cat(kept))

    def keep(start: int, hidden: torch.Tensor) -> None:
        lo, hi = max(first - start, 0), min(end - start, hidden.shape[0])
        if hi > lo:
            kept.append(hidden[lo:hi])

    llm.prefill(chunk, cache, prefill_chunk, on_hidden=keep)
    return llm.lm_head(torch.cat(kept))


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
    mode: KVMode
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
    base: KVMode
    base_prefill_chunk: int
    prefill_chunk: int
    keep_sink: int
    keep_recent: int
    base_seconds: float
    base_bytes_per_token: int
    wall_seconds: float
    modes: list[ModeResult]
    weights: str = "f32"  # the weights of the base and every mode (``llm.weights_mode``)
    ref_seconds: float = 0.0  # forward time of the f32-weights reference (0: none)
    # vs the reference (f32 weights + f32 KV): the base first, then each mode not equal to the base
    vs_f32_weights: list[ModeResult] = field(default_factory=list)

    @property
    def tokens_scored(self) -> int:
        first, end = scored_span(self.ctx)
        return self.chunks * (end - first)

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("modes", "vs_f32_weights")}
        d["base"] = self.base.name
        d["tokens_scored"] = self.tokens_scored
        d["base_tokens_per_s"] = self.chunks * self.ctx / self.base_seconds if self.base_seconds else None
        d["modes"] = {m.mode.name: m.to_json() for m in self.modes}
        d["vs_f32_weights"] = [
            {"label": weights_label(self, m), "weights": self.weights, "kv": m.mode.name} | m.to_json()
            for m in self.vs_f32_weights
        ]
        return d


def weights_label(r: PplResult, m: ModeResult, short: bool = False) -> str:
    """A row of the vs-f32-weights table: ``weights int8 · KV q8`` (short: ``int8 · q8``)."""
    label = f"{r.weights} · {m.mode}" if short else f"weights {r.weights} · KV {m.mode}"
    return label + (" (base)" if m.mode == r.base else "")


def _summarize(acc: dict[str, list[np.ndarray]]) -> tuple[dict[str, float], np.ndarray]:
    a = {k: np.concatenate(v) for k, v in acc.items()}
    return summarize(a["nll_q"], a["nll_base"], a["kld"], a["top_q"], a["top_base"]), a["kld"]


def run_ppl(
    llm: LLM,
    text: str,
    ctx: int = 512,
    modes: list[str | KVMode] | str = "q8",
    base: str | KVMode = "f32",
    n_chunks: int | None = None,
    prefill_chunk: int = 32,
    keep_sink: int = 0,
    keep_recent: int = 0,
    corpus_label: str = "",
    on_step: Any = None,
    sparse: Any = None,
    ref_llm: LLM | None = None,
) -> PplResult:
    """Score ``text`` under ``base`` and every mode of ``modes`` (one model, chunk-outer loop so each
    chunk's base logits are computed once). ``on_step(label)`` is called after every forward.

    ``ref_llm``: the same model with f32 weights (``llm`` having other weights): the base and each
    mode are also scored against it with an f32 cache, into ``vs_f32_weights``."""
    t_wall = time.perf_counter()
    modes, base = parse_modes(modes), KVMode.parse(base)
    if prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be at least 1 (got {prefill_chunk})")
    if keep_sink < 0 or keep_recent < 0:
        raise ValueError("--keep-sink / --keep-recent must be >= 0")
    tok = llm.tokenizer
    bos = tok.bos_prefix[0] if tok.bos_prefix else None
    ids = tok.encode(text)  # whole text at once; BOS first where the tokenizer adds one
    chunks = make_chunks(ids, ctx, n_chunks, bos)
    llm.check_fits(ctx)
    first, _ = scored_span(ctx)
    base_pc = ctx if base == MODES["f32"] else prefill_chunk
    test_options = CacheOptions(keep_sink=keep_sink, keep_recent=keep_recent)

    def same_as_base(m: KVMode) -> bool:
        # A mode equal to the base runs the base's exact path: KLD is then exactly 0 (determinism check).
        return m == base and not test_options.keeps_exact

    def plan(m: KVMode) -> tuple[int, CacheOptions | None]:
        return (base_pc, None) if same_as_base(m) else (prefill_chunk, test_options)

    # test modes with sparse decode (kvlens.kv.blocks.SparseConfig); the base stays dense
    test_llm = llm if sparse is None else llm.variant(sparse=sparse)
    # vs the f32-weights reference: the base, then every other mode (a mode named like the base is
    # the base's path, or the base with --keep-*: its combined cost is the base row's)
    ref_rows = [] if ref_llm is None else [base, *(m for m in modes if m != base)]
    acc = {m: {k: [] for k in _METRIC_KEYS} for m in modes}
    ref_acc = {m: {k: [] for k in _METRIC_KEYS} for m in ref_rows}

    def add(into: dict[str, list[np.ndarray]], metrics: dict[str, torch.Tensor]) -> None:
        for k, v in metrics.items():
            into[k].append(v.cpu().numpy())

    secs = dict.fromkeys(modes, 0.0)
    base_secs = ref_secs = 0.0
    for chunk in chunks:
        targets = torch.tensor(chunk[first + 1 :], dtype=torch.long)
        t0 = time.perf_counter()
        base_logits = scored_logits(llm, chunk, base, base_pc, first)
        base_secs += time.perf_counter() - t0
        lb = BaseLogProbs(base_logits)
        if on_step:
            on_step(base)
        if ref_rows:
            t0 = time.perf_counter()
            lr = BaseLogProbs(scored_logits(ref_llm, chunk, REF_KV, ctx, first))  # f32: one pass
            ref_secs += time.perf_counter() - t0
            add(ref_acc[base], chunk_metrics(lr, base_logits, targets))
            if on_step:
                on_step("f32 weights")
        for m in modes:
            pc, opts = plan(m)
            t0 = time.perf_counter()
            lq = scored_logits(test_llm, chunk, m, pc, first, opts)
            secs[m] += time.perf_counter() - t0
            add(acc[m], chunk_metrics(lb, lq, targets))
            if m in ref_acc and m != base:
                add(ref_acc[m], chunk_metrics(lr, lq, targets))
            if on_step:
                on_step(m)

    results = []
    for m in modes:
        stats, kld = _summarize(acc[m])
        note = MIRROR_NOTE if m.mirror else ""
        if same_as_base(m):
            note = "same path as the base (determinism check)"
        bpt = llm.new_cache(1, m).bytes_per_token()
        if sparse is not None:
            note = (
                f"sparse decode: {sparse.method}, budget {sparse.budget:g}, first {sparse.dense_layers} layers "
                f"dense, scored positions run as decode steps"
            )
        results.append(ModeResult(m, stats, bpt, secs[m], len(chunks) * ctx, plan(m)[0], kld, note))
    vs_ref = []
    for m in ref_rows:
        stats, kld = _summarize(ref_acc[m])
        s, pc = (base_secs, base_pc) if m == base else (secs[m], plan(m)[0])
        note = "cost of the weights alone" if m == REF_KV else f"cost of the weights and KV {m} combined"
        bpt = llm.new_cache(1, m).bytes_per_token()
        vs_ref.append(ModeResult(m, stats, bpt, s, len(chunks) * ctx, pc, kld, note))
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
        weights=getattr(llm, "weights_mode", "f32"),
        ref_seconds=ref_secs,
        vs_f32_weights=vs_ref,
    )

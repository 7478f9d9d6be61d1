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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..checks import check_counts
from ..engine.attention import check_backend_name
from ..engine.llm import LLM
from ..kv.blocks import SparseConfig
from ..kv.modes import CacheOptions, KVMode
from .common import REF_KV, CompareConfig, model_name, vs_f32_json
from .stats import summarize, target_nll

MIRROR_NOTE = (
    "measures nothing about prefill: every prefill sub-chunk reads the exact f32 mirror, never the "
    "int8 rows (the seed engine's behaviour), so this perplexity cannot see q8"
)
_METRIC_KEYS = ("nll_q", "nll_base", "kld", "top_q", "top_base")
OnStep = Callable[[str], None]


@dataclass
class PplConfig(CompareConfig):
    """``kvlens lab ppl``: chunks of ``ctx`` tokens (at most ``chunks`` of them), the second half of
    each scored; the base, test modes, weights, sub-chunks and sparse policy of :class:`CompareConfig`.
    ``attn_backend`` (e.g. ``numba``, ``numba-int16``): the test modes' attention backend; their scored
    positions then run one decode step each (the fused kernels are decode kernels); the base stays on
    the torch path."""

    ctx: int = 512
    chunks: int | None = None
    attn_backend: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_counts(self, "ctx", minimum=4)  # half of it is context, half is scored
        if self.chunks is not None:
            check_counts(self, "chunks")
        if self.attn_backend is not None:
            check_backend_name(self.attn_backend)  # before the model loads, not after it


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

    With sparse decode (``llm.sparse``) or a fused attention backend (not ``torch``), only the prefix
    up to ``first`` is prefilled; the scored positions are then run one decode step each
    (teacher-forced), since sparse attention and the fused kernels are decode paths: that is what
    such an engine computes for them."""
    cache = llm.new_cache(len(chunk), kv, options)
    end = len(chunk) - 1
    kept: list[torch.Tensor] = []
    if getattr(llm, "sparse", None) is not None or getattr(llm, "attn_backend", "torch") != "torch":
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
    return {
        "nll_q": target_nll(lq, targets),
        "nll_base": target_nll(base.logp, targets),
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
        d["vs_f32_weights"] = vs_f32_json(self, ModeResult.to_json)
        return d


def _summarize(acc: dict[str, list[np.ndarray]]) -> tuple[dict[str, float], np.ndarray]:
    a = {k: np.concatenate(v) for k, v in acc.items()}
    return summarize(a["nll_q"], a["nll_base"], a["kld"], a["top_q"], a["top_base"]), a["kld"]


def _add(into: dict[str, list[np.ndarray]], metrics: dict[str, torch.Tensor]) -> None:
    for k, v in metrics.items():
        into[k].append(v.cpu().numpy())


def sparse_note(sparse: SparseConfig) -> str:
    return (
        f"sparse decode: {sparse.method}, budget {sparse.budget:g}, first {sparse.dense_layers} layers "
        "dense, scored positions run as decode steps"
    )


class _PplRun:
    """One ``run_ppl``: what runs how (the plan), and per row its per-token metrics and forward seconds."""

    def __init__(self, llm: LLM, cfg: PplConfig, ref_llm: LLM | None, on_step: OnStep | None) -> None:
        self.llm, self.cfg, self.ref_llm = llm, cfg, ref_llm
        self.step = on_step or (lambda _label: None)
        self.first = scored_span(cfg.ctx)[0]
        self.base_pc = cfg.ctx if cfg.base == REF_KV else cfg.prefill_chunk  # f32 is chunk-invariant
        # test modes with sparse decode (kvlens.kv.blocks.SparseConfig); the base stays dense
        self.test_llm = llm if cfg.sparse is None else llm.variant(sparse=cfg.sparse)
        if cfg.attn_backend is not None:
            self.test_llm = self.test_llm.variant(attn_backend=cfg.attn_backend)
        # vs the f32-weights reference: the base, then every other mode (a mode named like the base is
        # the base's path, or the base with --keep-*: its combined cost is the base row's)
        self.ref_rows = [] if ref_llm is None else [cfg.base, *(m for m in cfg.kv if m != cfg.base)]
        self.acc = {m: {k: [] for k in _METRIC_KEYS} for m in cfg.kv}
        self.ref_acc = {m: {k: [] for k in _METRIC_KEYS} for m in self.ref_rows}
        self.secs = dict.fromkeys(cfg.kv, 0.0)
        self.base_secs = self.ref_secs = 0.0

    def plan(self, m: KVMode) -> tuple[int, CacheOptions | None]:
        """(prefill sub-chunk, cache options) of mode ``m``: the base's own path when it equals it."""
        cfg = self.cfg
        return (self.base_pc, None) if cfg.same_as_base(m) else (cfg.prefill_chunk, cfg.cache_options)

    def score(self, chunk: list[int]) -> None:
        """The base (and reference) logits of ``chunk`` once, then every mode against them."""
        cfg, first = self.cfg, self.first
        targets = torch.tensor(chunk[first + 1 :], dtype=torch.long)
        t0 = time.perf_counter()
        base_logits = scored_logits(self.llm, chunk, cfg.base, self.base_pc, first)
        self.base_secs += time.perf_counter() - t0
        lb = BaseLogProbs(base_logits)
        self.step(str(cfg.base))
        if self.ref_rows:
            t0 = time.perf_counter()
            lr = BaseLogProbs(scored_logits(self.ref_llm, chunk, REF_KV, cfg.ctx, first))  # f32: one pass
            self.ref_secs += time.perf_counter() - t0
            _add(self.ref_acc[cfg.base], chunk_metrics(lr, base_logits, targets))
            self.step("f32 weights")
        for m in cfg.kv:
            pc, options = self.plan(m)
            t0 = time.perf_counter()
            lq = scored_logits(self.test_llm, chunk, m, pc, first, options)
            self.secs[m] += time.perf_counter() - t0
            _add(self.acc[m], chunk_metrics(lb, lq, targets))
            if m in self.ref_acc and m != cfg.base:
                _add(self.ref_acc[m], chunk_metrics(lr, lq, targets))
            self.step(str(m))

    def mode_results(self, tokens_run: int) -> list[ModeResult]:
        cfg, out = self.cfg, []
        for m in cfg.kv:
            stats, kld = _summarize(self.acc[m])
            note = MIRROR_NOTE if m.mirror else ""
            if cfg.same_as_base(m):
                note = "same path as the base (determinism check)"
            if cfg.sparse is not None:
                note = sparse_note(cfg.sparse)
            if cfg.attn_backend is not None:
                note += (
                    "; " * bool(note) + f"attention {cfg.attn_backend}: scored positions run as decode steps"
                )
            bpt = self.llm.new_cache(1, m).bytes_per_token()
            out.append(ModeResult(m, stats, bpt, self.secs[m], tokens_run, self.plan(m)[0], kld, note))
        return out

    def ref_results(self, tokens_run: int) -> list[ModeResult]:
        out = []
        for m in self.ref_rows:
            stats, kld = _summarize(self.ref_acc[m])
            base = m == self.cfg.base
            secs, pc = (self.base_secs, self.base_pc) if base else (self.secs[m], self.plan(m)[0])
            note = "cost of the weights alone" if m == REF_KV else f"cost of the weights and KV {m} combined"
            bpt = self.llm.new_cache(1, m).bytes_per_token()
            out.append(ModeResult(m, stats, bpt, secs, tokens_run, pc, kld, note))
        return out


def run_ppl(
    llm: LLM,
    text: str,
    cfg: PplConfig,
    corpus_label: str = "",
    on_step: OnStep | None = None,
    ref_llm: LLM | None = None,
) -> PplResult:
    """Score ``text`` under ``cfg.base`` and every mode of ``cfg.kv`` (one model, chunk-outer loop so
    each chunk's base logits are computed once). ``on_step(label)`` is called after every forward.

    ``ref_llm``: the same model with f32 weights (``llm`` having other weights): the base and each
    mode are also scored against it with an f32 cache, into ``vs_f32_weights``."""
    t_wall = time.perf_counter()
    tok = llm.tokenizer
    bos = tok.bos_prefix[0] if tok.bos_prefix else None
    ids = tok.encode(text)  # whole text at once; BOS first where the tokenizer adds one
    chunks = make_chunks(ids, cfg.ctx, cfg.chunks, bos)
    llm.check_fits(cfg.ctx)
    run = _PplRun(llm, cfg, ref_llm, on_step)
    for chunk in chunks:
        run.score(chunk)
    tokens_run = len(chunks) * cfg.ctx
    return PplResult(
        model=model_name(llm),
        corpus=corpus_label,
        ctx=cfg.ctx,
        chunks=len(chunks),
        chunks_available=len(ids) // cfg.ctx,
        corpus_tokens=len(ids),
        bos_id=bos,
        base=cfg.base,
        base_prefill_chunk=run.base_pc,
        prefill_chunk=cfg.prefill_chunk,
        keep_sink=cfg.keep_sink,
        keep_recent=cfg.keep_recent,
        base_seconds=run.base_secs,
        base_bytes_per_token=llm.new_cache(1, cfg.base).bytes_per_token(),
        wall_seconds=time.perf_counter() - t_wall,
        modes=run.mode_results(tokens_run),
        weights=getattr(llm, "weights_mode", "f32"),
        ref_seconds=run.ref_secs,
        vs_f32_weights=run.ref_results(tokens_run),
    )

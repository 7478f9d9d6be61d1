"""``kvlens lab layers``: per layer and KV head, how much a KV mode changes the attention output.

Real Q/K/V come from one exact (f32) forward pass over a corpus window (every layer captured in the
same pass, :meth:`~kvlens.engine.llm.LLM.capture_qkv`). For each mode, K/V go through a
real :class:`~kvlens.kv.cache.KVCache` of that mode (write, then read: one quantizer implementation)
and the causal attention output of ``reference_attention`` in float64 is compared with the exact one:

    rel_err[layer, kv_head] = ‖out_mode − out_exact‖ / ‖out_exact‖   (over the head's query group, all positions)

The mode's rows are read as decode reads them (``q8+mirror`` decode reads int8; its prefill reads the
exact copy and would show 0). Heads above ``FLAG_FACTOR`` × the mode's median are flagged with a
likely cause: outlier channels (max channel |K| or |V| / median channel, far above the model's
usual), or an attention sink (mean attention weight on position 0 large).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checks import check_counts
from ..engine.attention import turn
from ..engine.llm import LLM
from ..kernels.reference import reference_attention
from ..kv.cache import rotations
from ..kv.modes import CacheOptions, KVMode, StoreKind
from ..models.loader import check_weights_mode
from ..report import CommandOutput, md_table, print_table, run_command, write_markdown
from .common import LabConfig, load_lab, model_name, plot_layers
from .ppl import make_chunks


@dataclass
class LayersConfig(LabConfig):
    """``kvlens lab layers``: ``chunks`` windows of ``ctx`` tokens (the ppl protocol's first chunks),
    Q/K/V captured from the model with ``weights``."""

    ctx: int = 512
    chunks: int = 1
    weights: str = "f32"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_weights_mode(self.weights)
        check_counts(self, "chunks")
        check_counts(self, "ctx", minimum=4)  # the CLI's floor, as ppl's


FLAG_FACTOR = 3.0  # a head this many times the mode's median error is flagged
OUTLIER_FACTOR = 2.0  # channel ratio this many times the model-wide median = "outlier channels"
SINK_WEIGHT = 0.5  # mean attention on position 0 at or above this = "attention sink"


def stored_kv(
    llm: LLM, qkv: list, mode: KVMode, options: CacheOptions | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K/V of every layer as a ``mode`` cache returns them after writing the exact rows (decode view),
    turned back to the model's basis where a kind is rotated (q8h, q4h). A recipe's K centers stay
    subtracted: attention does not see them (every score of a query moves by the same amount)."""
    n = qkv[0][1].shape[1]
    cache = llm.new_cache(n, mode, options)
    for i, (_q, k, v) in enumerate(qkv):
        cache.write(i, 0, k, v)
    out = []
    for i in range(len(qkv)):
        (k, v), (rk, rv) = cache.read(i, n, prefill=False), rotations(cache.k[i], cache.v[i])
        out.append((turn(k, rk, back=True), turn(v, rv, back=True)))
    return out


def channel_ratio(x: torch.Tensor) -> torch.Tensor:
    """Per KV head: max over channels of (max |x| over positions) / its median over channels. [KV]"""
    c = x.abs().amax(dim=1)  # [KV, d]
    return c.amax(dim=-1) / c.median(dim=-1).values.clamp_min(1e-12)


def flag_heads(
    err: np.ndarray,
    k_ratio: np.ndarray,
    v_ratio: np.ndarray,
    sink: np.ndarray,
    k_kind: StoreKind,
    v_kind: StoreKind,
) -> list[dict[str, Any]]:
    """Heads with error > FLAG_FACTOR × median (all arrays [layers, kv_heads]) and their likely causes."""
    nz = err[err > 0]
    if nz.size == 0:
        return []
    med = float(np.median(nz))
    k_med, v_med = float(np.median(k_ratio)), float(np.median(v_ratio))
    flagged = []
    for layer, head in zip(*np.nonzero(err > FLAG_FACTOR * med), strict=True):
        causes = []
        if k_kind != StoreKind.F32 and k_ratio[layer, head] >= OUTLIER_FACTOR * k_med:
            causes.append(
                f"outlier K channels (max/median channel {k_ratio[layer, head]:.1f}, model median {k_med:.1f})"
            )
        if v_kind != StoreKind.F32 and v_ratio[layer, head] >= OUTLIER_FACTOR * v_med:
            causes.append(
                f"outlier V channels (max/median channel {v_ratio[layer, head]:.1f}, model median {v_med:.1f})"
            )
        if sink[layer, head] >= SINK_WEIGHT:
            causes.append(f"attention sink (mean weight on position 0: {sink[layer, head]:.2f})")
        flagged.append(
            {
                "layer": int(layer),
                "kv_head": int(head),
                "rel_err": float(err[layer, head]),
                "times_median": float(err[layer, head] / med),
                "causes": causes or ["no single cause found (not outlier channels, not a sink)"],
            }
        )
    return sorted(flagged, key=lambda f: -f["rel_err"])


@dataclass
class LayersResult:
    model: str
    corpus: str
    ctx: int
    windows: int
    keep_sink: int
    keep_recent: int
    err: dict[KVMode, np.ndarray]  # mode -> [layers, kv_heads]
    max_abs: dict[KVMode, float]  # mode -> max |Δout| over everything
    mean_abs: dict[KVMode, float]  # mode -> mean |Δout|
    k_ratio: np.ndarray
    v_ratio: np.ndarray
    sink: np.ndarray
    flagged: dict[KVMode, list[dict[str, Any]]]
    seconds: float
    weights: str = "f32"  # the weights Q/K/V were captured with (``llm.weights_mode``)

    def median(self, mode: KVMode) -> float:
        e = self.err[mode]
        return float(np.median(e[e > 0])) if np.any(e > 0) else 0.0

    def to_json(self) -> dict[str, Any]:
        d = {
            k: getattr(self, k)
            for k in ("model", "corpus", "weights", "ctx", "windows", "keep_sink", "keep_recent", "seconds")
        }
        d["k_channel_ratio"], d["v_channel_ratio"] = self.k_ratio.tolist(), self.v_ratio.tolist()
        d["sink_weight"] = self.sink.tolist()
        d["modes"] = {
            m.name: {
                "rel_err": e.tolist(),
                "rel_err_median": self.median(m),
                "rel_err_max": float(e.max()),
                "max_abs_dout": self.max_abs[m],
                "mean_abs_dout": self.mean_abs[m],
                "flagged": self.flagged[m],
            }
            for m, e in self.err.items()
        }
        return d


@torch.inference_mode()
def run_layers(
    llm: LLM,
    text: str,
    cfg: LayersConfig,
    corpus_label: str = "",
    on_step: Callable[[str], None] | None = None,
) -> LayersResult:
    """Relative attention-output error per (layer, KV head) for each mode over ``cfg.chunks`` windows
    of ``cfg.ctx`` tokens (the ppl protocol's first chunks); errors pool squared norms over windows."""
    t0 = time.perf_counter()
    modes, ctx, keep_sink, keep_recent = cfg.kv, cfg.ctx, cfg.keep_sink, cfg.keep_recent
    tok = llm.tokenizer
    windows = make_chunks(tok.encode(text), ctx, cfg.chunks, tok.bos_prefix[0] if tok.bos_prefix else None)
    model = llm.config
    n_l, n_kv = model.n_layers, model.n_kv_heads
    group = model.group
    num = {m: np.zeros((n_l, n_kv)) for m in modes}
    den = np.zeros((n_l, n_kv))
    max_abs, sum_abs, count = dict.fromkeys(modes, 0.0), dict.fromkeys(modes, 0.0), 0
    k_ratio, v_ratio, sink = (np.zeros((n_l, n_kv)) for _ in range(3))
    options = cfg.cache_options
    for ids in windows:
        qkv = llm.capture_qkv(ids)
        stored = {m: stored_kv(llm, qkv, m, options) for m in modes}
        n = len(ids)
        pos = torch.arange(n, device=llm.device)
        for layer, (q, k, v) in enumerate(qkv):
            q64 = q.double()
            ref, w = reference_attention(
                q64, k.double(), v.double(), pos, model.layer_windows[layer], return_weights=True
            )
            den[layer] += ref.pow(2).view(n_kv, group, n, -1).sum(dim=(1, 2, 3)).cpu().numpy()
            k_ratio[layer] += channel_ratio(k).cpu().numpy() / len(windows)
            v_ratio[layer] += channel_ratio(v).cpu().numpy() / len(windows)
            # mean weight on position 0 over the group's heads and every query after position 0
            sink[layer] += w[:, 1:, 0].reshape(n_kv, -1).mean(dim=1).cpu().numpy() / len(windows)
            count += ref.numel()
            for m in modes:
                kq, vq = stored[m][layer]
                diff = (
                    reference_attention(q64, kq.double(), vq.double(), pos, model.layer_windows[layer]) - ref
                )
                num[m][layer] += diff.pow(2).view(n_kv, group, n, -1).sum(dim=(1, 2, 3)).cpu().numpy()
                max_abs[m] = max(max_abs[m], float(diff.abs().max()))
                sum_abs[m] += float(diff.abs().sum())
            if on_step:
                on_step(f"layer {layer}")
    err = {m: np.sqrt(num[m] / np.maximum(den, 1e-300)) for m in modes}
    flagged = {m: flag_heads(err[m], k_ratio, v_ratio, sink, m.k, m.v) for m in modes}
    return LayersResult(
        model_name(llm), corpus_label, ctx, len(windows), keep_sink, keep_recent, err, max_abs,
        {m: sum_abs[m] / max(count, 1) for m in modes}, k_ratio, v_ratio, sink, flagged,
        time.perf_counter() - t0, llm.weights_mode,
    )  # fmt: skip


# -- output ------------------------------------------------------------------------------------------
def describe(r: LayersResult) -> list[str]:
    lines = [
        f"model {r.model}, weights {r.weights}; corpus {r.corpus}: {r.windows} window(s) of {r.ctx} tokens, "
        "real Q/K/V of every layer",
        "rel. error = ‖attn_out(mode K/V) − attn_out(exact)‖ / ‖attn_out(exact)‖ per (layer, KV head), "
        "causal float64 reference attention; K/V written to and read back from a real cache of the mode",
        f"flagged: > {FLAG_FACTOR:g}× the mode's median; outlier channels: max/median channel |K| or |V| "
        f"≥ {OUTLIER_FACTOR:g}× the model's median ratio; sink: mean weight on position 0 ≥ {SINK_WEIGHT:g}",
    ]
    for m in r.err:
        if m.mirror:
            lines.append(f"{m}: decode view (int8 rows); its prefill reads the exact copy (error 0)")
    if r.keep_sink or r.keep_recent:
        lines.append(
            f"kept: first {r.keep_sink} positions of the window in the f16 sink store, last {r.keep_recent} exact"
        )
    return lines


def summary_rows(r: LayersResult) -> tuple[list[str], list[list[str]]]:
    headers = [
        "mode",
        "stores",
        "median rel err",
        "max rel err (layer.head)",
        "max/median",
        "flagged",
        "max|Δout|",
        "mean|Δout|",
    ]
    rows = []
    for m, e in r.err.items():
        li, hi = np.unravel_index(int(e.argmax()), e.shape)
        rows.append(
            [m.name, m.label, f"{r.median(m):.2e}", f"{e.max():.2e} ({li}.{hi})",
             f"{e.max() / r.median(m):.2f}×" if r.median(m) > 0 else "-", len(r.flagged[m]),
             f"{r.max_abs[m]:.2e}", f"{r.mean_abs[m]:.2e}"]
        )  # fmt: skip
    return headers, rows


def layer_rows(r: LayersResult) -> tuple[list[str], list[list[str]]]:
    """Per layer: RMS error over KV heads for each mode, plus the K channel ratio and the sink weight."""
    headers = ["layer", *(m.name for m in r.err), "K ch. ratio (max head)", "sink w (max head)"]
    rows = []
    for layer in range(r.k_ratio.shape[0]):
        rows.append(
            [layer, *(f"{np.sqrt((e[layer] ** 2).mean()):.2e}" for e in r.err.values()),
             f"{r.k_ratio[layer].max():.1f}", f"{r.sink[layer].max():.2f}"]
        )  # fmt: skip
    return headers, rows


def flag_lines(r: LayersResult) -> list[str]:
    lines = []
    for m, fl in r.flagged.items():
        if not fl:
            lines.append(f"[{m}] no head above {FLAG_FACTOR:g}× the median")
        for f in fl:
            lines.append(
                f"[{m}] layer {f['layer']} KV head {f['kv_head']}: rel err {f['rel_err']:.2e} "
                f"({f['times_median']:.1f}× median) — {'; '.join(f['causes'])}"
            )
    return lines


def write_report(r: LayersResult, out_dir: str | Path, command: str = "") -> Path:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    plot_layers({m.name: e for m, e in r.err.items()}, d / "layers_error.png")
    md = ["# kvlens lab layers", ""] + (["```", command, "```", ""] if command else [])
    md += [f"- {line}" for line in describe(r)] + [""]
    md += [md_table(*summary_rows(r)), "![per-layer error](layers_error.png)", ""]
    md += ["## Flagged heads", "", *[f"- {s}" for s in flag_lines(r)], ""]
    md += ["## Per layer", "", md_table(*layer_rows(r))]
    return write_markdown(d, "layers.md", "\n".join(md))


def render(r: LayersResult) -> None:
    print("\n".join(describe(r)))
    print_table("Attention-output error per mode", *summary_rows(r))
    print_table("Per layer (RMS over KV heads)", *layer_rows(r))
    print("\n".join(flag_lines(r)))
    print(f"time {r.seconds:.1f} s")


OUTPUT = CommandOutput(render, LayersResult.to_json, write_report)


def main(cfg: LayersConfig, json_out: bool = False, report: str | Path | None = None) -> LayersResult:
    """The body of ``kvlens lab layers``."""
    llm, text, label = load_lab(cfg.model, cfg.corpus, "f32", cfg.weights)
    steps = cfg.chunks * llm.config.n_layers
    return run_command(
        "lab layers", steps, lambda step: run_layers(llm, text, cfg, label, step), OUTPUT, json_out, report
    )

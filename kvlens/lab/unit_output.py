"""Output of ``kvlens lab unit`` (:mod:`.unit`): the seed line, the tables, JSON and the figure."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..report import figure, save_figure

if TYPE_CHECKING:
    from .unit import UnitResult


def seed_line(p: dict[str, Any]) -> str:
    """The seed's printout, on one line."""
    tgt = p["quantize"].upper()
    f4 = " ".join(f"{x:.4f}" for x in p["out_f"])
    q4 = " ".join(f"{x:.4f}" for x in p["out_q"])
    r = "k" if "k" in p["quantize"] else "v"
    tail = f"avg {r.upper()} per-token scale ~ {p[f'{r}_scale_mean']:.5f} - {p['scheme']} step ~ {p[f'{r}_step_mean']:.5f}"
    return (
        f"L{p['seq_len']} hd{p['head_dim']} | fp32-KV vs {p['scheme']}-{tgt} attention output: "
        f"max|d_out| {p['max_abs_diff']:.5f} mean|d_out| {p['mean_abs_diff']:.5f} "
        f"out_f[0..3] {f4} out_q[0..3] {q4} ({tail})"
    )


def _fmt(p: dict[str, Any], key: str, short: bool = False) -> str:
    x = p[key]
    s = f"{x:.6f}" if key == "cosine" else f"{x:.3g}" if short else f"{x:.4g}"
    if p["trials"] < 2 or key not in p["std"] or (short and key == "mean_signed_diff"):
        return s
    sd = p["std"][key]
    if short:  # compact tables: the spread as a percentage of the mean
        return f"{s} ±{100 * sd / abs(x):.0f}%" if x else s
    return f"{s} ± {sd:.2g}"


# the one-point table: (label, measured key, predicted key or None)
_POINT_ROWS = (
    ("max|Δ|", "max_abs_diff", None),
    ("mean|Δ|", "mean_abs_diff", "predicted_mean_abs_diff"),
    ("rel L2 ‖Δ‖/‖out‖", "rel_l2", "predicted_rel_l2"),
    ("cosine(out_f, out_q)", "cosine", None),
    ("mean signed Δ", "mean_signed_diff", None),
    ("  t-statistic (pooled)", "signed_t", None),
    ("  fraction Δ > 0", "frac_positive", None),
    ("K step mean", "k_step_mean", None),
    ("V step mean", "v_step_mean", None),
    ("KL(w ‖ ŵ) attention weights", "kl_weights", None),
    ("effective keys 1/Σw²", "eff_keys", None),
    ("rms(out_f)", "out_rms", None),
)


def render(result: UnitResult, console: Any = None) -> None:
    """Print the seed line(s) and a table (rows = metrics for one point; one row per L for sweeps)."""
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    if console is None and not con.is_terminal:
        con.width = 160  # pipes and files: no 80-column wrapping
    pts = result.points if result.amplitude is None else []
    for p in pts:
        con.print(seed_line(p), markup=False, highlight=False, soft_wrap=True)
    c = result.config
    title = f"lab unit: {c.scheme} on {c.quantize.upper()}, dist {c.dist}, trials {c.trials} (mean ± std), seed {c.seed}"
    if c.attn_backend:
        title += f", attention {c.attn_backend}"
    src = (result.points or result.amplitude or [{}])[0]
    if "layer" in src:
        head = "all heads" if src["head"] is None else f"head {src['head']}"
        title += (
            f"\n{src['model']} layer {src['layer']} {head}, text {src['text']}, last query of each window"
        )
    if len(pts) == 1:
        p = pts[0]
        t = Table(title=title)
        for col in ("metric", "measured", "predicted (1st order)"):
            t.add_column(col)
        rows = list(_POINT_ROWS)
        if "kernel_rel_l2" in p:
            rows.append((f"rel L2 {c.attn_backend} vs reference, same K/V", "kernel_rel_l2", None))
        for label, key, pred in rows:
            t.add_row(label, _fmt(p, key), _fmt(p, pred) if pred else "")
        t.add_row("bits per K/V value", f"{p['bits_per_value']:g}", "")
        con.print(t)
    else:
        rows_src = pts or result.amplitude or []
        t = Table(title=title + (" — amplitude analysis" if result.amplitude else ""))
        lead = ["L"] if pts else ["scaled", "a"]
        cols = {"max_abs_diff": "max|Δ|", "mean_abs_diff": "mean|Δ|", "predicted_mean_abs_diff": "pred",
                "rel_l2": "rel L2", "predicted_rel_l2": "pred", "mean_signed_diff": "signed Δ",
                "signed_t": "t", "kl_weights": "KL(w‖ŵ)", "eff_keys": "eff keys", "out_rms": "rms out"}  # fmt: skip
        if c.attn_backend:
            cols["kernel_rel_l2"] = "kernel rel L2"
        for col in lead + list(cols.values()):
            t.add_column(col)
        for p in rows_src:
            head = [str(p["seq_len"])] if pts else [p["scaled"].upper(), f"{p['amplitude']:g}"]
            t.add_row(*head, *(_fmt(p, k, short=True) for k in cols))
        con.print(t)
    for line in (result.verdicts or {}).values():
        con.print(line, markup=False, highlight=False, soft_wrap=True)


def _clean(p: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in p.items() if not k.startswith("_")}


def to_json(result: UnitResult) -> str:
    """One object for a single point, a list for a sweep, ``{rows, verdicts, config}`` for amplitudes."""
    if result.amplitude is not None:
        obj: Any = {"amplitude": [_clean(r) for r in result.amplitude], "verdicts": result.verdicts,
                    "config": asdict(result.config)}  # fmt: skip
    elif len(result.points) == 1:
        obj = _clean(result.points[0])
    else:
        obj = [_clean(p) for p in result.points]
    return json.dumps(obj, indent=2)


def write_plot(result: UnitResult, path: str | Path) -> Path:
    """PNG: error vs L (sweep), rel L2 vs amplitude (amplitude mode), else a histogram of Δ."""
    fig, ax = figure().subplots(figsize=(7, 4.5))
    c = result.config
    if result.amplitude is not None:
        for which in ("v", "k"):
            rs = [r for r in result.amplitude if r["scaled"] == which]
            ax.plot(
                [r["amplitude"] for r in rs], [r["rel_l2"] for r in rs], "o-", label=f"{which.upper()} × a"
            )
        ax.set(xlabel="amplitude a", ylabel="rel L2 ‖Δ‖/‖out‖")
    elif len(result.points) > 1:
        L = [p["seq_len"] for p in result.points]
        for key, label in (("mean_abs_diff", "mean|Δ| measured"), ("predicted_mean_abs_diff", "mean|Δ| predicted"),
                           ("max_abs_diff", "max|Δ| measured")):  # fmt: skip
            err = [p["std"][key] for p in result.points] if c.trials > 1 else None
            ax.errorbar(L, [p[key] for p in result.points], yerr=err, marker="o", capsize=3, label=label)
        ax.set(xscale="log", yscale="log", xlabel="L (keys)", ylabel="|Δout|")
    else:
        p = result.points[0]
        d = p["_deltas"].numpy()
        ax.hist(d, bins=max(10, min(80, d.size // 8)), density=True, alpha=0.7, label="measured Δ")
        sigma = p["predicted_mean_abs_diff"] / math.sqrt(2 / math.pi)
        xs = np.linspace(d.min(), d.max(), 200)
        ax.plot(
            xs,
            np.exp(-(xs**2) / (2 * sigma**2)) / (sigma * math.sqrt(2 * math.pi)),
            label="predicted N(0, σ)",
        )
        ax.set(xlabel="Δout = out_q - out_f", ylabel="density")
    ax.set_title(f"{c.scheme} on {c.quantize.upper()}, dist {c.dist}, L {','.join(map(str, c.seq_len))}")
    ax.legend()
    return save_figure(fig, path)

"""``kvlens lab sweep-report DB --out DIR``: a sweep store as Markdown plus PNG plots.

Figures (ppl cells): the accuracy/memory frontier per model (PPL ratio and KLD mean vs KV bytes per
token), KLD vs context length, and K-only vs V-only quantization. Every point carries its ±1
standard error as llama-perplexity computes it; every figure names the commands that reproduce it.
Greedy, layers and needle cells get a table each. Tables and figure plumbing are the lab's
(:mod:`.report`).
"""

from __future__ import annotations

import shlex
from collections import Counter, defaultdict
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from ..checks import option_name
from ..kv.modes import KVMode, StoreKind
from ..report import figure, label_axes, md_table, save_figure, write_markdown
from .store import INPUTS, Store
from .sweep_spec import cell_label

KLD_LABEL = "KLD(base ‖ mode), mean per token"

ERR_NOTE = (
    "Error bars: ±1 standard error, as llama-perplexity computes it (KLD: over scored tokens; PPL ratio: "
    "from the standard error of mean ln(p_base/p_mode), which pairs each token with the base's)."
)


def _short(path: str) -> str:
    return Path(path).name


def _series_key(c: dict[str, Any]) -> str:
    return f"{_short(c['corpus'])}, ctx {c['ctx']}" + (
        f", weights {c['weights']}" if c["weights"] != "f32" else ""
    )


def command_weights(measurement: str) -> str:
    """The weights a measurement's lab command runs when ``--weights`` is not given (its config's)."""
    from .greedy import GreedyConfig
    from .layers import LayersConfig
    from .needle import NeedleConfig
    from .ppl import PplConfig

    config = {"ppl": PplConfig, "greedy": GreedyConfig, "layers": LayersConfig, "needle": NeedleConfig}
    return next(f.default for f in fields(config[measurement]) if f.name == "weights")


def _number(x: float) -> str:
    """``x`` short (``0.5``, ``64``) where that reads back as ``x``, else exactly (``:g`` keeps 6 digits)."""
    short = f"{x:g}"
    return short if float(short) == x else repr(x)


def cell_command(c: dict[str, Any]) -> str:
    """The single lab command that measures this cell with the same code and settings."""
    m = c["measurement"]
    args = ["kvlens", "lab", m, "--model", c["model"], "--corpus", c["corpus"], "--kv", c["kv"]]
    if c["weights"] != command_weights(m):
        args += ["--weights", c["weights"]]
    if m == "ppl":
        args += [
            "--ctx",
            c["ctx"],
            "--chunks",
            c["chunks"],
            "--base",
            c["base"],
            "--prefill-chunk",
            c["prefill_chunk"],
        ]
    elif m == "greedy":
        args += ["--ctx", c["ctx"], "--prompts", c["prompts"], "--tokens", c["tokens"], "--base", c["base"]]
        args += ["--prefill-chunk", c["prefill_chunk"]]
    elif m == "layers":
        args += ["--ctx", c["ctx"], "--chunks", c["chunks"]]
    else:
        args += [
            "--ctx",
            c["ctx"],
            "--depth",
            ",".join(map(_number, c["depths"])),
            "--sparse",
            c["method"],
        ]
        args += [
            "--sparse-budget",
            ",".join(map(_number, c["budgets"])),
            "--dense-layers",
            c["dense_layers"],
        ]
        args += ["--seed", c["seed"]]
    for k in ("keep_sink", "keep_recent"):
        if c.get(k):
            args += [option_name(k), c[k]]
    return shlex.join(str(a) for a in args)


# -- figures -----------------------------------------------------------------------------------------
def _errbar(ax, x, y, err, label: str, linestyle: str = "-") -> None:
    ax.errorbar(x, y, yerr=err, marker="o", markersize=4, capsize=3, linestyle=linestyle, label=label)


def plot_frontier(model: str, rows: list[dict[str, Any]], path: Path) -> Path:
    """PPL ratio and KLD mean vs KV bytes/token, one line per (corpus, ctx, weights), modes labelled."""
    plt = figure()
    fig, (ax_p, ax_k) = plt.subplots(1, 2, figsize=(11, 4.2))
    by = defaultdict(list)
    for r in rows:
        by[_series_key(r["config"])].append(r)
    for i, (label, rs) in enumerate(sorted(by.items())):
        rs = sorted(rs, key=lambda r: r["bytes_per_token"])
        # series spread sideways by a few % so equal-size modes do not hide each other
        x = [r["bytes_per_token"] * (1 + 0.015 * (i - (len(by) - 1) / 2)) for r in rs]
        for ax, col in ((ax_p, "ppl_ratio"), (ax_k, "kld_mean")):
            _errbar(ax, x, [r[col] for r in rs], [r[f"{col}_err"] for r in rs], label, "none")
            for xi, r in zip(x, rs, strict=True):
                ax.annotate(r["kv"], (xi, r[col]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax_p.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax_p.set_ylabel("PPL(mode) / PPL(base)")
    ax_p.ticklabel_format(axis="y", useOffset=False)
    ax_k.set_ylabel(KLD_LABEL)
    ax_k.set_yscale("log")
    for ax in (ax_p, ax_k):
        ax.set_xlabel("KV cache bytes per token (all layers; series spread ±few % for legibility)")
        ax.legend(fontsize=7)
    fig.suptitle(f"{model}: accuracy vs KV memory (±1 s.e.)")
    return save_figure(fig, path)


def plot_kld_vs_ctx(rows: list[dict[str, Any]], path: Path) -> Path:
    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    by = defaultdict(list)
    for r in rows:
        c = r["config"]
        by[f"{_short(c['model'])} {c['kv']} ({_short(c['corpus'])}, w {c['weights']})"].append(r)
    for label, rs in sorted(by.items()):
        rs = sorted(rs, key=lambda r: r["ctx"])
        _errbar(
            ax, [r["ctx"] for r in rs], [r["kld_mean"] for r in rs], [r["kld_mean_err"] for r in rs], label
        )
    ax.set_xscale("log", base=2)
    ctxs = sorted({r["ctx"] for r in rows})
    ax.set_xticks(ctxs, [str(c) for c in ctxs])
    ax.minorticks_off()
    ax.set_yscale("log")
    label_axes(
        ax, "context length (tokens per chunk; the second half is scored)", KLD_LABEL,
        "KL divergence vs context length (±1 s.e.)", legend=7,
    )  # fmt: skip
    return save_figure(fig, path)


def side(kv: str) -> str | None:
    """'K only' / 'V only' when just one of K and V is stored below f32, 'K and V' when both are."""
    mode = KVMode.parse(kv)
    k, v = mode.k != StoreKind.F32, mode.v != StoreKind.F32
    return "K and V" if k and v else "K only" if k else "V only" if v else None


def plot_k_vs_v(rows: list[dict[str, Any]], path: Path) -> Path:
    """Grouped bars of KLD mean ± s.e. per (model, corpus, ctx, weights): K-only, V-only, both."""
    plt = figure()
    groups = sorted({(_short(r["model"]), _series_key(r["config"])) for r in rows})
    modes = sorted({r["kv"] for r in rows}, key=lambda m: (["K only", "V only", "K and V"].index(side(m)), m))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) * len(modes) / 2), 4.2))
    width = 0.8 / len(modes)
    for i, m in enumerate(modes):
        y, e = [], []
        for g in groups:
            hit = [r for r in rows if r["kv"] == m and (_short(r["model"]), _series_key(r["config"])) == g]
            y.append(hit[0]["kld_mean"] if hit else np.nan)
            e.append(hit[0]["kld_mean_err"] if hit else 0)
        ax.bar(np.arange(len(groups)) + i * width, y, width, yerr=e, capsize=3, label=f"{m} ({side(m)})")
    ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2, [f"{a}\n{b}" for a, b in groups], fontsize=7)
    ax.set_yscale("log")
    label_axes(ax, None, KLD_LABEL, "Quantizing K only vs V only (±1 s.e.)", legend=7)
    return save_figure(fig, path)


# -- Markdown ----------------------------------------------------------------------------------------
def _ppl_table(rows: list[dict[str, Any]]) -> str:
    headers = ["model", "weights", "corpus", "ctx", "chunks", "KV", "KV B/token", "PPL", "PPL ratio", "KLD mean",
               "KLD 99%", "same top", "command"]  # fmt: skip
    out = []
    for r in rows:
        c, s = r["config"], r["result"]["modes"][r["kv"]]["stats"]
        out.append([
            _short(c["model"]), c["weights"], _short(c["corpus"]), c["ctx"], r["result"]["chunks"], r["kv"],
            r["bytes_per_token"], f"{s['ppl_q']:.4f}", f"{r['ppl_ratio']:.5f} ± {r['ppl_ratio_err']:.5f}",
            f"{r['kld_mean']:.3e} ± {r['kld_mean_err']:.1e}", f"{s['kld_p99']:.3e}", f"{s['same_top_p']:.2f}%",
            f"`{cell_command(c)}`",
        ])  # fmt: skip
    return md_table(headers, out)


def _mode(r: dict[str, Any]) -> dict[str, Any]:
    """A row's result for its KV mode."""
    return r["result"]["modes"][r["kv"]]


def _section(
    rows: list[dict[str, Any]], measurement: str, title: str, columns: list[str], cells
) -> list[str]:
    """A Markdown section for the rows of one ``measurement`` (none: no section): ``cells(row)``
    gives a row's cells between its label and its command."""
    body = [[cell_label(r["config"]), *cells(r), f"`{cell_command(r['config'])}`"]
            for r in rows if r["measurement"] == measurement]  # fmt: skip
    return [f"## {title}\n", md_table(["cell", *columns, "command"], body)] if body else []


def _other_tables(rows: list[dict[str, Any]]) -> list[str]:
    return [
        *_section(rows, "greedy", "Greedy agreement with the base",
                  ["token agreement", "identical prompts", "first div. median"],
                  lambda r: [f"{100 * (g := _mode(r))['agreement']:.1f}%",
                             f"{g['identical_prompts']}/{r['result']['n_prompts']}", g["first_divergence_median"]]),
        *_section(rows, "layers", "Attention-output error per layer and head",
                  ["median rel err", "max rel err", "flagged heads"],
                  lambda r: [f"{(m := _mode(r))['rel_err_median']:.2e}", f"{m['rel_err_max']:.2e}", len(m["flagged"])]),
        *_section(rows, "needle", "Needle recall (over depths)", ["recall"],
                  lambda r: [", ".join(f"{k}: {v:.0%}" for k, v in r["result"]["recall"].items())]),
    ]  # fmt: skip


def _provenance(store: Store, rows: list[dict[str, Any]], failed: list[dict[str, Any]]) -> list[str]:
    machines = sorted({f"{m['host']}: {m['cpu']}, {m['logical_cores']} cores ({', '.join(m['isa'])}), "
                       f"torch {m['torch']}, {m['torch_threads']} threads" for r in rows if (m := r["machine"])})  # fmt: skip
    builds = sorted({f"kvlens {r['kvlens_version']} @ {r['git_commit'] or 'no git checkout'}" for r in rows})
    secs = sum(r["run_seconds"] or 0 for r in rows), sum(r["load_seconds"] or 0 for r in rows)
    lines = [
        f"- {len(rows)} cells done, {len(failed)} failed; cells' run time {secs[0]:.0f} s, model loads {secs[1]:.0f} s"
    ]
    lines += [f"- machine: {m}" for m in machines] + [f"- code: {b}" for b in builds] + _inputs(rows)
    lines += [
        f"- sweep run {r['run_id']} ({r['started_at']}, {r['executor']}): `{r['command']}`"
        for r in store.runs()
    ]
    if failed:
        lines += ["", "Failed cells:", ""] + [f"- {cell_label(r['config'])}: {r['error']}" for r in failed]
    return lines


def _cells(n: int) -> str:
    return f"{n} cell" if n == 1 else f"{n} cells"


def _inputs(rows: list[dict[str, Any]]) -> list[str]:
    """``- model NAME: sha256 … (N cells)`` per model and corpus: the files the cells measured."""
    lines = []
    for kind in ("model", "corpus"):
        for name in sorted({r[kind] for r in rows}):
            digests = Counter(
                (r["result"].get(INPUTS) or {}).get(f"{kind}_sha256") for r in rows if r[kind] == name
            )
            said = [f"sha256 {d[:12]}… ({_cells(n)})" if d else f"sha256 not recorded ({_cells(n)}, stored by "
                    "an older kvlens)" for d, n in sorted(digests.items(), key=lambda x: x[0] or "")]  # fmt: skip
            lines.append(f"- {kind} {name}: {', '.join(said)}")
    return lines


def _figure(title: str, alt: str, png: Path, reproduce: str) -> list[str]:
    """A figure's subsection: heading, image, the error-bar note and how to reproduce it."""
    return [f"### {title}\n", f"![{alt}]({png.name})\n", ERR_NOTE, reproduce, ""]


def write_report(db: str | Path, out_dir: str | Path, command: str) -> Path:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory (the report's folder)")
    out.mkdir(parents=True, exist_ok=True)
    with Store(db, create=False) as store:
        rows, failed = store.rows("done"), store.rows("failed")
        lines = [f"# Sweep report: {Path(db).name}\n", *_provenance(store, rows, failed), ""]
        runs = store.runs()
    sweep_cmd = runs[-1]["command"] if runs else "kvlens lab sweep SPEC"
    reproduce = f"Reproduce: `{sweep_cmd}` then `{command}`."
    ppl = [r for r in rows if r["measurement"] == "ppl"]
    if ppl:
        lines += ["## Perplexity and KL divergence vs the base\n", _ppl_table(ppl)]
        for model in sorted({r["model"] for r in ppl}):
            png = plot_frontier(
                _short(model), [r for r in ppl if r["model"] == model], out / f"frontier-{_short(model)}.png"
            )
            lines += _figure(f"Accuracy vs KV memory: {_short(model)}", "frontier", png, reproduce)
        png = plot_kld_vs_ctx(ppl, out / "kld-vs-ctx.png")
        lines += _figure("KL divergence vs context length", "kld vs ctx", png, reproduce)
        kv_rows = [r for r in ppl if side(r["kv"]) is not None]
        if any(side(r["kv"]) != "K and V" for r in kv_rows):
            lines += _figure(
                "K only vs V only", "k vs v", plot_k_vs_v(kv_rows, out / "k-vs-v.png"), reproduce
            )
    lines += _other_tables(rows)
    return write_markdown(out, "README.md", "\n".join(lines) + "\n")


def cli(db: str, out_dir: str) -> None:
    import typer

    if not Path(db).is_file():
        raise ValueError(f"no sweep store at {db}")
    command = shlex.join(["kvlens", "lab", "sweep-report", db, "--out", out_dir])
    typer.echo(f"wrote {write_report(db, out_dir, command)}")

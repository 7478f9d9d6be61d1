"""`kvlens lab sweep-report` on stores written by hand: every figure, table cell and command is checked
against the numbers put in (no model runs), and every cell's command parses back, through the real
CLI, to that cell's settings."""

from __future__ import annotations

import hashlib
import json
import shlex

import numpy as np
import pytest
import typer.main
from matplotlib.axes import Axes

from kvlens.cli import app
from kvlens.lab import sweep_report
from kvlens.lab.store import CellOutcome, Store
from kvlens.lab.sweep_report import cell_command, write_report


def config(measurement: str = "ppl", **over: object) -> dict:
    """A cell's configuration with every key any measurement's command reads."""
    c = {
        "measurement": measurement, "model": "/m/one.gguf", "weights": "f32", "kv": "q8",
        "corpus": "/c/text.txt", "ctx": 64, "chunks": 2, "base": "f32", "prefill_chunk": 16,
        "prompts": 4, "tokens": 8, "depths": [0.25, 0.5], "method": "quest", "budgets": [0.5, 64.0],
        "dense_layers": 3, "seed": 7,
    }  # fmt: skip
    return c | over


def ppl_result(kv: str, ppl_q: float, kld: float, p99: float, chunks: int = 2) -> dict:
    stats = {"ppl_q": ppl_q, "ppl_base": 10.0, "kld_p99": p99, "kld_max": 9.0, "same_top_p": 97.25}
    return {"chunks": chunks, "modes": {kv: {"stats": stats}}}


def ppl_metrics(ratio: float, ratio_err: float, kld: float, kld_err: float, nbytes: int) -> dict:
    return {"ppl_ratio": ratio, "ppl_ratio_err": ratio_err, "kld_mean": kld, "kld_mean_err": kld_err,
            "same_top_p": 97.25, "bytes_per_token": nbytes}  # fmt: skip


def record(store: Store, run: int, c: dict, result: dict | None = None, metrics: dict | None = None,
           error: str | None = None, run_s: float = 1.0, load_s: float = 0.0) -> None:  # fmt: skip
    cj = json.dumps(c, sort_keys=True)
    status = "failed" if error else "done"
    out = CellOutcome(
        hashlib.sha256(cj.encode()).hexdigest(),
        cj,
        status,
        error,
        result,
        metrics or {},
        run_seconds=run_s,
        load_seconds=load_s,
    )
    store.record(out, run)


def parse_cli(command: str) -> tuple[str, dict]:
    """The (command name, parsed options) the real ``kvlens`` parser makes of ``command``."""
    words = shlex.split(command)
    assert words[0] == "kvlens"
    cmd, ctx, words = typer.main.get_command(app), None, words[1:]
    while hasattr(cmd, "get_command"):  # a group: descend by name
        ctx = cmd.make_context(cmd.name or "kvlens", [], parent=ctx, resilient_parsing=True)
        cmd, words = cmd.get_command(ctx, words[0]), words[1:]
    return cmd.name, cmd.make_context(cmd.name, words, parent=ctx).params


# -- each cell's command: the lab command with the cell's settings ---------------------------------------
def test_ppl_command_is_the_cell():
    c = config(weights="int8", keep_sink=4, keep_recent=0)
    assert cell_command(c) == (
        "kvlens lab ppl --model /m/one.gguf --corpus /c/text.txt --kv q8 --weights int8 --ctx 64 "
        "--chunks 2 --base f32 --prefill-chunk 16 --keep-sink 4"
    )
    name, p = parse_cli(cell_command(c))
    assert name == "ppl"
    want = {"model": "/m/one.gguf", "corpus": "/c/text.txt", "kv": "q8", "weights": "int8", "ctx": 64,
            "chunks": 2, "base": "f32", "prefill_chunk": 16, "keep_sink": 4, "keep_recent": 0}  # fmt: skip
    assert {k: p[k] for k in want} == want


def test_greedy_and_layers_commands_are_the_cells():
    c = config("greedy", prompts=5, tokens=9, prefill_chunk=32, keep_recent=16)
    name, p = parse_cli(cell_command(c))
    want = {"ctx": 64, "prompts": 5, "tokens": 9, "base": "f32", "prefill_chunk": 32, "keep_recent": 16}
    assert name == "greedy" and {k: p[k] for k in want} == want and "weights" not in cell_command(c)
    name, p = parse_cli(cell_command(config("layers", chunks=3, weights="int4")))
    assert name == "layers" and (p["ctx"], p["chunks"], p["weights"]) == (64, 3, "int4")


def test_needle_and_layers_commands_name_the_cells_weights():
    """`lab needle` runs the file's own weights (auto) unless told, the others f32: each command names
    the cell's weights wherever they differ, and its depths and budgets come back as given."""
    c = config("needle", ctx=256)
    assert cell_command(c) == (
        "kvlens lab needle --model /m/one.gguf --corpus /c/text.txt --kv q8 --weights f32 --ctx 256 "
        "--depth 0.25,0.5 --sparse quest --sparse-budget 0.5,64 --dense-layers 3 --seed 7"
    )
    name, p = parse_cli(cell_command(c))
    assert (name, p["weights"], p["dense_layers"], p["seed"], p["sparse"]) == ("needle", "f32", 3, 7, "quest")
    for measurement, weights in (
        ("needle", "int8"),
        ("needle", "auto"),
        ("layers", "auto"),
        ("layers", "f32"),
    ):
        assert parse_cli(cell_command(config(measurement, weights=weights)))[1]["weights"] == weights


def closed(fig, path):
    """save_figure without the PNG (the plotted data is what these tests read)."""
    sweep_report.figure().close(fig)
    return path


# -- the report ----------------------------------------------------------------------------------------
@pytest.fixture
def report(tmp_path, monkeypatch):
    """A store of two models, two contexts, K-only / V-only / both / f32 modes, greedy, layers and needle
    cells, one failed cell and two runs; the report written, each plotted series captured."""
    db = tmp_path / "s.sqlite"
    with Store(db) as store:
        store.begin_run("kvlens lab sweep first.toml", "local", "first.toml", "")
        run = store.begin_run("kvlens lab sweep second.toml", "local", "second.toml", "")
        cells = [  # (model, kv, ctx, ppl_q, kld, kld_err, ratio_err, bytes)
            ("/m/one.gguf", "q8", 128, 10.5, 1.5e-3, 1.5e-4, 2e-3, 900),  # less KLD at the longer context
            ("/m/one.gguf", "q8", 64, 10.25, 2e-3, 2e-4, 1e-3, 900),
            ("/m/one.gguf", "q8-k", 64, 10.125, 1e-3, 1e-4, 5e-4, 1200),
            ("/m/one.gguf", "q8-v", 64, 10.0625, 5e-4, 5e-5, 2.5e-4, 1200),
            ("/m/one.gguf", "f32", 64, 10.0, 1e-9, 1e-10, 1e-9, 1600),
            ("/m/two.gguf", "q8", 64, 20.5, 3e-3, 3e-4, 1.5e-3, 500),
        ]
        for model, kv, ctx, ppl_q, kld, kld_err, ratio_err, nbytes in cells:
            c = config(model=model, kv=kv, ctx=ctx)
            metrics = ppl_metrics(ppl_q / 10, ratio_err, kld, kld_err, nbytes)
            record(store, run, c, ppl_result(kv, ppl_q, kld, kld * 7), metrics, run_s=2.0, load_s=0.5)
        greedy = {"n_prompts": 4, "modes": {"q8": {"agreement": 0.875, "identical_prompts": 3,
                                                   "first_divergence_median": 11}}}  # fmt: skip
        record(store, run, config("greedy"), greedy, run_s=2.0, load_s=0.5)
        layers = {
            "modes": {"q8": {"rel_err_median": 1.5e-3, "rel_err_max": 4.5e-2, "flagged": [[0, 1], [1, 0]]}}
        }
        record(store, run, config("layers"), layers, run_s=2.0, load_s=0.5)
        record(store, run, config("needle"), {"recall": {"dense": 1.0, "quest 0.5": 0.75}}, run_s=2.0)
        record(store, run, config(kv="q8h"), error="RuntimeError: boom", run_s=9.0)
    series, bars = [], []
    plot_errbar, plot_bar = sweep_report._errbar, Axes.bar

    def errbar(ax, x, y, err, label, linestyle="-"):
        series.append((label, list(x), list(y), list(err)))
        plot_errbar(ax, x, y, err, label, linestyle)

    def bar(ax, x, height, width, **kw):
        bars.append((kw["label"], list(height), list(kw["yerr"])))
        return plot_bar(ax, x, height, width, **kw)

    monkeypatch.setattr(Axes, "bar", bar)
    monkeypatch.setattr(sweep_report, "save_figure", closed)
    monkeypatch.setattr(sweep_report, "_errbar", errbar)
    md = write_report(db, tmp_path / "rep", "kvlens lab sweep-report s.sqlite --out rep").read_text()
    return md, series, bars


def md_rows(md: str, first_cell: str) -> list[list[str]]:
    return [
        [x.strip() for x in ln.strip("|").split("|")]
        for ln in md.splitlines()
        if ln.startswith(f"| {first_cell}")
    ]


def test_ppl_table_cells_are_the_stored_numbers(report):
    md, _, _ = report
    rows = {(r[0], r[3], r[5]): r for r in md_rows(md, "one.gguf") + md_rows(md, "two.gguf")}
    r = rows[("one.gguf", "64", "q8-k")]
    assert r[1:8] == ["f32", "text.txt", "64", "2", "q8-k", "1200", "10.1250"]
    assert r[8:12] == ["1.01250 ± 0.00050", "1.000e-03 ± 1.0e-04", "7.000e-03", "97.25%"]
    assert r[12] == f"`{cell_command(config(kv='q8-k'))}`"
    assert len(rows) == 6


def test_provenance_counts_and_times(report):
    md, _, _ = report
    # 9 done cells of 2.0 s run / 0.5 s load but the needle's 0 s load; the failed cell is not summed
    assert "- 9 cells done, 1 failed; cells' run time 18 s, model loads 4 s" in md
    assert "- ppl one.gguf weights f32 kv q8h text.txt ctx 64: RuntimeError: boom" in md
    assert md.count("Reproduce: `kvlens lab sweep second.toml` then `kvlens lab sweep-report") == 4
    assert "first.toml` then" not in md


def test_frontier_per_model_and_kld_by_context(report):
    _, series, _ = report
    # a figure per model, in it a series per (corpus, ctx): PPL ratio, then KLD, modes sorted by bytes
    ctx64 = [s for s in series if s[0] == "text.txt, ctx 64"]
    assert [len(s[1]) for s in ctx64] == [4, 4, 1, 1]  # one.gguf's four modes; two.gguf's one
    assert [len(s[1]) for s in series if s[0] == "text.txt, ctx 128"] == [1, 1]
    (_, x, y, err), (_, _, yk, ek) = ctx64[:2]
    assert y == [10.25 / 10, 10.125 / 10, 10.0625 / 10, 1.0] and err == [1e-3, 5e-4, 2.5e-4, 1e-9]
    assert yk == [2e-3, 1e-3, 5e-4, 1e-9] and ek == [2e-4, 1e-4, 5e-5, 1e-10]
    spread = [xi / b for xi, b in zip(x, [900, 1200, 1200, 1600], strict=True)]
    assert max(spread) - min(spread) < 1e-12 and abs(spread[0] - 1) < 0.05  # one series, one offset
    by_ctx = next(s for s in series if s[0] == "one.gguf q8 (text.txt, w f32)")
    assert by_ctx[1:] == ([64, 128], [2e-3, 1.5e-3], [2e-4, 1.5e-4])


def test_k_only_v_only_bars(report):
    _, _, bars = report
    got = {label: (h, e) for label, h, e in bars}
    assert set(got) == {"q8-k (K only)", "q8-v (V only)", "q8 (K and V)"}
    # groups: (one.gguf, ctx 128), (one.gguf, ctx 64), (two.gguf, ctx 64); a missing cell is a NaN bar
    assert got["q8 (K and V)"] == ([1.5e-3, 2e-3, 3e-3], [1.5e-4, 2e-4, 3e-4])
    heights, errs = got["q8-k (K only)"]
    assert heights[1] == 1e-3 and errs == [0, 1e-4, 0] and np.isnan(heights[0]) and np.isnan(heights[2])
    assert got["q8-v (V only)"][0][1] == 5e-4 and got["q8-v (V only)"][1] == [0, 5e-5, 0]


def test_greedy_layers_and_needle_tables(report):
    md, _, _ = report
    (g,) = md_rows(md, "greedy one.gguf")
    assert g[1:4] == ["87.5%", "3/4", "11"]
    (lay,) = md_rows(md, "layers one.gguf")
    assert lay[1:4] == ["1.50e-03", "4.50e-02", "2"]
    (nd,) = md_rows(md, "needle one.gguf")
    assert nd[1] == "dense: 100%, quest 0.5: 75%"


def test_k_vs_v_figure_only_with_a_one_sided_mode(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep_report, "save_figure", closed)
    db = tmp_path / "s.sqlite"
    with Store(db) as store:
        run = store.begin_run("kvlens lab sweep s.toml", "local", "s.toml", "")
        for kv in ("q8", "f16"):
            record(
                store,
                run,
                config(kv=kv),
                ppl_result(kv, 10.5, 1e-3, 7e-3),
                ppl_metrics(1.05, 1e-3, 1e-3, 1e-4, 900),
            )
    md = write_report(db, tmp_path / "rep", "x").read_text()
    assert "k-vs-v.png" not in md and "kld-vs-ctx.png" in md

"""``kvlens lab ppl`` output: the protocol in words, the tables, llama-perplexity's blocks, the Markdown
report, and the command's body (model loading, progress, ``--json``). The run itself is :mod:`.ppl`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..report import CommandOutput, md_table, print_table, run_command, write_markdown
from .common import REF_KV, VS_F32_TITLE, header_notes, load_compare, plot_kld, weights_label
from .ppl import MIRROR_NOTE, ModeResult, PplConfig, PplResult, run_ppl, scored_span
from .stats import format_kld_report

HEADERS = ["mode", "KV B/token", "PPL", "ΔPPL", "PPL ratio", "KLD mean", "KLD 99%", "same top p", "tok/s"]


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
    lines += header_notes(r, "KV costs are vs", ", one pass per chunk")
    return lines


def _row(label: str, m: ModeResult) -> list[Any]:
    s = m.stats
    return [
        label,
        m.bytes_per_token,
        f"{s['ppl_q']:.4f}",
        f"{s['ppl_diff']:+.5f} ± {s['ppl_diff_err']:.5f}",
        f"{s['ppl_ratio']:.5f}",
        f"{s['kld_mean']:.3e} ± {s['kld_mean_err']:.1e}",
        f"{s['kld_p99']:.3e}",
        f"{s['same_top_p']:.2f}%",
        f"{m.tokens_per_s:.0f}",
    ]


def _tps(r: PplResult, seconds: float) -> str:
    return f"{r.chunks * r.ctx / seconds:.0f}" if seconds else "nan"


def summary_rows(r: PplResult) -> tuple[list[str], list[list[str]]]:
    """The KV modes vs the base (same weights)."""
    ppl_base = f"{r.modes[0].stats['ppl_base']:.4f}" if r.modes else ""
    rows = [
        [f"{r.base} (base)", r.base_bytes_per_token, ppl_base, "", "", "", "", "", _tps(r, r.base_seconds)]
    ]
    rows += [_row(f"{m.mode}{' *' if m.mode.mirror else ''}", m) for m in r.modes]
    return HEADERS, rows


def weights_rows(r: PplResult) -> tuple[list[str], list[list[str]]]:
    """The base and every mode vs the reference (f32 weights + f32 KV); no rows without one."""
    if not r.vs_f32_weights:
        return HEADERS, []
    ref_bpt = r.base_bytes_per_token if r.base == REF_KV else ""
    ref_ppl = f"{r.vs_f32_weights[0].stats['ppl_base']:.4f}"
    rows = [[f"f32 · {REF_KV} (reference)", ref_bpt, ref_ppl, *[""] * 5, _tps(r, r.ref_seconds)]]
    rows += [_row(weights_label(r, m, short=True), m) for m in r.vs_f32_weights]
    return ["weights · KV", *HEADERS[1:]], rows


def mode_header(r: PplResult, m: ModeResult) -> str:
    return (
        f"=== {m.mode} ({m.mode.label}; {m.bytes_per_token} KV bytes/token; prefill sub-chunk "
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


def _titles(r: PplResult) -> tuple[str, str]:
    w = f", weights {r.weights}" if r.vs_f32_weights else ""
    return (
        f"KV modes vs {r.base}{w} ({r.tokens_scored} tokens scored)",
        f"{VS_F32_TITLE}: weights {r.weights} alone, and with each KV mode",
    )


def write_report(r: PplResult, out_dir: str | Path, command: str = "") -> Path:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    plot_kld({m.mode.name: m.kld for m in r.modes}, d / "ppl_kld.png")
    headers, rows = summary_rows(r)
    md = ["# kvlens lab ppl", ""]
    if command:
        md += ["```", command, "```", ""]
    md += [f"- {line}" for line in describe(r)] + [f"- wall time {r.wall_seconds:.1f} s", ""]
    if r.vs_f32_weights:
        md += [f"**{_titles(r)[0]}**", ""]
    md += [md_table(headers, rows), "![KLD distribution per mode](ppl_kld.png)", ""]
    if r.vs_f32_weights:
        md += [f"## {_titles(r)[1]}", "", md_table(*weights_rows(r))]
    for m in r.modes:
        md += [f"## {m.mode}", ""]
        if m.note:
            md += [f"**{m.mode} {m.note}.**", ""]
        md += ["```", mode_header(r, m), format_kld_report(m.stats), "```", ""]
    for m in r.vs_f32_weights:
        md += [f"## {weights_label(r, m)} vs weights f32 · KV {REF_KV}", "", f"{m.note}.", ""]
        md += ["```", format_kld_report(m.stats), "```", ""]
    return write_markdown(d, "ppl.md", "\n".join(md))


def render(r: PplResult) -> None:
    """The terminal output: the protocol and llama-perplexity's blocks, then the tables."""
    print(format_text(r))
    main_title, ref_title = _titles(r)
    print_table(main_title, *summary_rows(r))
    if r.vs_f32_weights:
        print_table(ref_title, *weights_rows(r))
    for m in r.modes:
        if m.mode.mirror:
            print(f"* {m.mode} {MIRROR_NOTE}")
    print(f"wall time {r.wall_seconds:.1f} s")


OUTPUT = CommandOutput(render, PplResult.to_json, write_report)


def main(cfg: PplConfig, json_out: bool = False, report: str | Path | None = None) -> PplResult:
    """The body of ``kvlens lab ppl``."""
    llm, ref, text, label = load_compare(cfg)
    available = len(llm.tokenizer.encode(text)) // max(cfg.ctx, 1)
    n = min(cfg.chunks or available, available) or 1
    steps = n * (1 + len(cfg.kv) + (ref is not None))
    return run_command(
        "lab ppl", steps, lambda step: run_ppl(llm, text, cfg, label, step, ref), OUTPUT, json_out, report
    )

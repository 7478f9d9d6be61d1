"""Write labout34.json: report/output.py, report/command.py, lab/common.py, lab/unit_output.py,
lab/unit_kernel.py. Each bug's text must occur once and the planted file must compile."""

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from planted_list import write_list  # noqa: E402

O, C = "kvlens/report/output.py", "kvlens/report/command.py"
L, U, K = "kvlens/lab/common.py", "kvlens/lab/unit_output.py", "kvlens/lab/unit_kernel.py"

BUGS = [
    ("out-progress-interval-from-start", O, "if now - last >= interval or", "if now - start >= interval or"),
    ("out-progress-last-line-always", O, "or (done == total and wrote):", "or done == total:"),
    ("out-progress-last-not-moved", O, "            last, wrote = now, True\n", "            wrote = True\n"),
    ("out-progress-bar-in-pipes", O, "    if not sys.stderr.isatty():\n        yield plain_progress", "    if False:\n        yield plain_progress"),
    ("out-md-cells-unescaped", O, '["| " + " | ".join(str(c).replace("|", "\\\\|") for c in r)', '["| " + " | ".join(str(c) for c in r)'),
    ("out-md-separator-short", O, '"|" + "|".join("---" for _ in headers)', '"|" + "|".join("---" for _ in headers[1:])'),
    ("out-json-nan-kept", O, "return float(x) if math.isfinite(x) else None", "return float(x)"),
    ("out-json-tuple-not-cleaned", O, "if isinstance(x, (list, tuple)):", "if isinstance(x, list):"),
    ("out-json-numpy-int-kept", O, "        if isinstance(x, np.integer):\n            return int(x)\n", ""),
    ("out-markdown-no-parents", O, "d.mkdir(parents=True, exist_ok=True)", "d.mkdir(exist_ok=True)"),
    ("cmd-json-and-tables", C, "    else:\n        output.render(result)\n", "    output.render(result)\n"),
    ("cmd-report-line-on-stdout", C, 'print(f"report: {path}", file=sys.stderr)', 'print(f"report: {path}")'),
    ("cmd-report-missing-silent", C, '            raise ValueError(f"{name} writes no report")\n        path', '            return result\n        path'),
    ("cmd-command-line-no-prefix", C, '"kvlens " + " ".join(sys.argv[1:])', '" ".join(sys.argv[1:])'),
    ("lab-modes-not-deduplicated", L, "return list(dict.fromkeys(KVMode.parse(n) for n in names))", "return [KVMode.parse(n) for n in names]"),
    ("lab-all-anywhere", L, 'if names == ["all"]:', 'if "all" in names:'),
    ("lab-empty-mode-list", L, '    if not names:\n        raise ValueError(f"no KV mode given; choose from: {\', \'.join(MODES)}")\n', ""),
    ("lab-weights-unchecked", L, "    check_weights_mode(weights)\n    llm", "    llm"),
    ("lab-default-backend", L, 'llm = kvlens.load(model, kv=base, attn_backend="torch", weights=weights)', "llm = kvlens.load(model, kv=base, weights=weights)"),
    ("lab-reference-file-weights", L, 'return kvlens.load(model, kv="f32", attn_backend="torch", weights="f32")', 'return kvlens.load(model, kv="f32", attn_backend="torch", weights="auto")'),
    ("lab-prefill-chunk-zero", L, "if self.prefill_chunk < 1:", "if self.prefill_chunk < 0:"),
    ("lab-same-as-base-ignores-recent", L, "return mode == self.base and not (self.keep_sink or self.keep_recent)", "return mode == self.base and not self.keep_sink"),
    ("lab-base-label-dropped", L, 'return label + (" (base)" if m.mode == r.base else "")', "return label"),
    ("lab-kept-line-swapped", L, 'f"kept in test modes: first {r.keep_sink} positions in the f16 sink store, last {r.keep_recent} exact"', 'f"kept in test modes: first {r.keep_recent} positions in the f16 sink store, last {r.keep_sink} exact"'),
    ("lab-kld-plot-zero-unclipped", L, "logs = {m: np.log10(np.maximum(k, 1e-12)) for m, k in kld_by_mode.items()}", "logs = {m: np.log10(k) for m, k in kld_by_mode.items()}"),
    ("lab-cache-options-late", L, "        self.cache_options  # noqa: B018 - validates keep_sink / keep_recent now\n", ""),
    ("lab-vs-f32-kv-base", L, '"kv": m.mode.name}', '"kv": r.base.name}'),
    ("unit-seed-line-v-first", U, 'r = "k" if "k" in p["quantize"] else "v"', 'r = "v" if "v" in p["quantize"] else "k"'),
    ("unit-fmt-two-trials-no-std", U, 'if p["trials"] < 2 or', 'if p["trials"] <= 2 or'),
    ("unit-fmt-signed-percent", U, "100 * sd / abs(x)", "100 * sd / x"),
    ("unit-json-private-kept", U, 'return {k: v for k, v in p.items() if not k.startswith("_")}', "return dict(p)"),
    ("unit-json-single-as-list", U, "    elif len(result.points) == 1:\n        obj = _clean(result.points[0])\n", ""),
    ("unit-kernel-column-dropped", U, '        if c.attn_backend:\n            cols["kernel_rel_l2"] = "kernel rel L2"\n', ""),
    ("unit-point-kernel-row-dropped", U, '        if "kernel_rel_l2" in p:', '        if False:'),
    ("ukern-scheme-unchecked", K, '    if scheme != "q8":\n        raise ValueError', '    if False:\n        raise ValueError'),
    ("ukern-int-needs-v", K, 'if IntAttn.parse(backend) is not None and "k" not in quantize:', 'if IntAttn.parse(backend) is not None and "v" not in quantize:'),
    ("ukern-all-stores-q8", K, "kind = StoreKind.Q8 if role in quantize else StoreKind.F32", "kind = StoreKind.Q8"),
    ("ukern-no-ksum", K, 'with_ksum=role == "k" and d % 32 == 0', "with_ksum=False"),
]

write_list(HERE / "labout34.json", BUGS)

"""Write bench34.json: kvlens/bench/attention.py. Each bug's text must occur once and the planted
file must compile."""

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from planted_list import write_list  # noqa: E402

A = "kvlens/bench/attention.py"

BUGS = [
    ("att-bytes-k-twice", A, "return n_kv * ctx * (m.k.row_bytes(hd) + m.v.row_bytes(hd))", "return n_kv * ctx * 2 * m.k.row_bytes(hd)"),
    ("att-plan-one-llc", A, "want = {m: max(1, math.ceil(4 * llc / layer_bytes(m, n_kv, ctx, hd))) for m in modes}", "want = {m: max(1, math.ceil(llc / layer_bytes(m, n_kv, ctx, hd))) for m in modes}"),
    ("att-plan-shrink-to-zero", A, "want = {m: max(1, int(n * budget / total)) for m, n in want.items()}", "want = {m: int(n * budget / total) for m, n in want.items()}"),
    ("att-plan-budget-ignored", A, "    if total > budget:  # shrink", "    if False:  # shrink"),
    ("att-layers-shared", A, "return [(k0, v0)] + [(clone(k0), clone(v0)) for _ in range(n_layers - 1)]", "return [(k0, v0)] + [(k0, v0) for _ in range(n_layers - 1)]"),
    ("att-intdot-any-k", A, '"numba-intdot": kinds[0].int8,', '"numba-intdot": True,'),
    ("att-sdpa-any-cache", A, '"torch-sdpa": exact,', '"torch-sdpa": True,'),
    ("att-time-per-sweep", A, "return (time.perf_counter() - t0) / (times * n)", "return (time.perf_counter() - t0) / times"),
    ("att-base-dequant-for-f32", A, 'base = best.get((m, "dequant-sdpa")) if m != "f32" else sdpa', 'base = best.get((m, "dequant-sdpa"))'),
    ("att-gib-not-gb", A, "gbs = nbytes / t / 1e9", "gbs = nbytes / t / 2**30"),
    ("att-median-is-min", A, "1e6 * t, 1e6 * spread(ts).median, 1e6 * max(ts)", "1e6 * t, 1e6 * min(ts), 1e6 * max(ts)"),
    ("att-mirror-accepted", A, "bad_mode = next((m for m in modes if m not in MODES or MODES[m].mirror), None)", "bad_mode = next((m for m in modes if m not in MODES), None)"),
    ("att-sdpa-baseline-f32-missing", A, 'store_modes = modes + (["f32"] if "torch-sdpa" in backends and "f32" not in modes else [])', "store_modes = modes"),
    ("att-copy-vs-read-swapped", A, "gbs / bw.copy_gb_per_s, gbs / bw.read_gb_per_s,", "gbs / bw.read_gb_per_s, gbs / bw.copy_gb_per_s,"),
]

write_list(HERE / "bench34.json", BUGS)

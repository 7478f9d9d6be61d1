"""The sixteenth session: the hamlet recipes of ../hamlet-sink/plan_sink.sh (rerun into this folder) run the way the engine decodes, on
the plan's held-out chunks. Each scored position is one decode step through the numba kernels (the
layer-by-layer path; these recipes hold packed kinds and per-head layers, which the fused step does
not take), with the sink row from the f16 sink store. The recipe files' own keep_sink applies: no lab
option is set. q8 with nothing kept is run the same way: its KLD is the budget's definition.

Run from the repository root: .venv/bin/python docs/beyond-q8/q4search/hamlet-sink-store/verify_engine.py
"""

import json
import sys

from kvlens.kv.modes import KVMode
from kvlens.lab import plan
from kvlens.lab.common import load_compare
from kvlens.lab.ppl import PplConfig, _PplRun

D = "docs/beyond-q8/q4search/hamlet-sink-store"
recipes = sys.argv[1:] or ["recipe-sink1-t0.8.json"]
cfg = plan.PlanConfig(
    model="smollm2", corpus="hamlet_gut", kld_budget=0.000858, calib_chunks=4, calib_spread=True,
    ctx=256, heldout_chunks=8, prefill_chunk=32, kv="q8", candidates="q8h,q7h,q6h,q5h,q4h",
)  # fmt: skip
llm, _, text, _ = load_compare(cfg)
_, held = plan.plan_chunks(llm, text, cfg)
modes = [KVMode.parse(f"{D}/{name}") for name in recipes] + [KVMode.parse("q8")]
ppl_cfg = PplConfig(model="smollm2", kv=modes, base="f32", ctx=256, prefill_chunk=32, attn_backend="numba")
run = _PplRun(llm, ppl_cfg, None, None)
for chunk in held:
    run.score(chunk)
c = llm.config
q8_bytes = KVMode.parse("q8").bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim)
rows = []
for r in run.mode_results(len(held) * cfg.ctx):
    cache = llm.new_cache(cfg.ctx, r.mode)
    rows.append(
        {
            "kv": r.mode.name,
            "keep_sink": cache.sink,
            "bytes_per_token": r.bytes_per_token,
            "sink_bytes": cache.sink_bytes(),
            "vs_q8": r.bytes_per_token / q8_bytes,
            "vs_q8_with_sink_over_ctx": (r.bytes_per_token + cache.sink_bytes() / cfg.ctx) / q8_bytes,
            "kld_mean": r.stats["kld_mean"],
            "kld_mean_err": r.stats["kld_mean_err"],
            "ppl_ratio": r.stats["ppl_ratio"],
            "same_top_p": r.stats["same_top_p"],
            "within_budget": r.stats["kld_mean"] <= cfg.kld_budget,
            "note": r.note,
        }
    )
print(
    json.dumps({"held_out_index": plan.chunk_layout(4, 8, True)[1], "ctx": cfg.ctx, "rows": rows}, indent=1)
)

"""As run in the fifteenth session (2026-12-02): the tenth session's hamlet recipes (chosen without a kept
sink), verified on the same held-out chunks with the first position kept exact (the lab's keep_sink)."""

import json

from kvlens.kv.modes import KVMode
from kvlens.lab import plan
from kvlens.lab.common import load_compare

D = "docs/beyond-q8/q4search/hamlet-4chunks-spread"
cfg = plan.PlanConfig(
    model="smollm2",
    corpus="hamlet_gut",
    kld_budget=0.000858,
    calib_chunks=4,
    calib_spread=True,
    ctx=256,
    heldout_chunks=8,
    prefill_chunk=32,
    kv="q8",
    candidates="q8h,q7h,q6h,q5h,q4h",
    keep_sink=1,  # in the verification's test modes (plan.verify passes it on)
)
llm, _, text, _ = load_compare(cfg)
_, held = plan.plan_chunks(llm, text, cfg)
out = {}
for name in ("recipe-bq8-t0.8.json", "recipe-bq8-t0.9.json", "recipe-bq8-t1.0.json"):
    out[name] = plan.verify(llm, held, cfg, KVMode.parse(f"{D}/{name}"))
print(json.dumps(out, indent=1))

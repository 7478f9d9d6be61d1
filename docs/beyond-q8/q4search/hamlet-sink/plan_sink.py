"""As run in the fifteenth session (2026-12-02): `kvlens lab plan --reuse` on hamlet_gut (the tenth
session's spread sensitivities, measured without a kept sink) at q8's held-out KLD as the budget, with
the first position kept exact (the lab's CacheOptions.keep_sink, as `lab ppl --keep-sink 1`) in the
choice's calibration checks and in the held-out verification (the recipe and q8 beside it). Written
before `lab plan --keep-sink` existed (a later commit of the same session), which gives the same result.

    python plan_sink.py T > plan-sink1-tT.json      # T: the calibration target (0.8, 0.9, 1.0)
"""

import sys

from kvlens.kv.modes import CacheOptions
from kvlens.lab import plan, sensitivity

HERE = "docs/beyond-q8/q4search"
sensitivity.CacheOptions = lambda **kw: CacheOptions(keep_sink=1, **kw)  # every calibration pass
_PplConfig = plan.PplConfig
plan.PplConfig = lambda **kw: _PplConfig(**kw, keep_sink=1)  # the held-out verification's test modes

T = float(sys.argv[1])
cfg = plan.PlanConfig(
    model="smollm2",
    corpus="hamlet_gut",
    kld_budget=0.000858,
    calib_target=T,
    calib_chunks=4,
    calib_spread=True,
    ctx=256,
    heldout_chunks=8,
    prefill_chunk=32,
    kv="q8",
    candidates="q8h,q7h,q6h,q5h,q4h",
    out=f"{HERE}/hamlet-sink/recipe-sink1-t{T}.json",
    reuse=f"{HERE}/hamlet-4chunks-spread/plan-b0.0008-t0.9.json",
)
plan.main(cfg, json_out=True)

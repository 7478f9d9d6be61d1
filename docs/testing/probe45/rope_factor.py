"""Before/after probe of the forty-fifth session: a GGUF's linear RoPE scaling keys.

Writes a tiny Gemma-3 whose global layers are scaled linearly by 4 (the transformers model is the
reference), stores the scaling in the GGUF under each spelling llama.cpp reads, and prints kvlens'
largest logit distance from transformers' float64 forward, with the f32 tolerance beside it.
Run from the repository root:
    PYTHONPATH=tests .venv/bin/python docs/testing/probe45/rope_factor.py
"""

import tempfile
from pathlib import Path

from bounds import f32_forward_tol
from test_gemma3 import IDS, WINDOW, float64_logits
from tiny_models import write_gemma3

import kvlens

LINEAR4 = {"rope_type": "linear", "factor": 4.0}
CASES = {
    "type linear + scaling.factor 4": {
        "gemma3.rope.scaling.type": "linear",
        "gemma3.rope.scaling.factor": 4.0,
    },
    "scaling.factor 4 alone": {"gemma3.rope.scaling.factor": 4.0},
    "scale_linear 4 alone (older key)": {"gemma3.rope.scale_linear": 4.0},
    "type linear + scale_linear 4": {"gemma3.rope.scaling.type": "linear", "gemma3.rope.scale_linear": 4.0},
}
root = Path(tempfile.mkdtemp())
for i, (label, meta) in enumerate(CASES.items()):
    hf, path = write_gemma3(root / f"{i}.gguf", sliding_window=WINDOW, global_rope=LINEAR4, meta=meta)
    ref = float64_logits(hf, IDS)
    try:
        llm = kvlens.load(path, kv="f32", weights="f32", attn_backend="torch")
        off = (llm.logits(IDS).double() - ref).abs().max().item()
        print(
            f"{label}: max |logit - transformers| = {off:.3g} (tolerance {f32_forward_tol(llm.config, ref):.3g})"
        )
    except Exception as e:  # what a user would see
        print(f"{label}: refused: {e}")

"""RoPE position scaling against transformers in float64: Gemma-3-4B's linear scaling of its global
layers, read from a GGUF as llama.cpp writes it, while the windowed layers keep their own unscaled
base. (Llama-3's frequency scaling: test_models' tiny Llama.)"""

from __future__ import annotations

import dataclasses

from bounds import f32_forward_tol
from test_gemma3 import IDS, WINDOW, float64_logits, step_logits
from tiny_models import write_gemma3

import kvlens
from kvlens.models.transformer import Transformer

LINEAR = {"rope_type": "linear", "factor": 4.0}


def test_gemma3_linear_scaling_of_the_global_layers_only(tmp_path):
    hf, path = write_gemma3(
        tmp_path / "linear.gguf",
        sliding_window=WINDOW,
        global_rope=LINEAR,
        meta={"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 4.0},
    )
    llm = kvlens.load(path, kv="f32", weights="f32", attn_backend="torch")
    assert llm.config.rope_scaling == LINEAR
    ref = float64_logits(hf, IDS)
    tol = f32_forward_tol(llm.config, ref)
    for out in (llm.logits(IDS, prefill_chunk=5), step_logits(llm, IDS)):
        assert (out.double() - ref).abs().max().item() <= tol
    # the scaling is felt: without it the same weights are far from the reference
    llm.model = Transformer(dataclasses.replace(llm.config, rope_scaling=None), llm.model.w)
    assert (llm.logits(IDS).double() - ref).abs().max().item() > 100 * tol

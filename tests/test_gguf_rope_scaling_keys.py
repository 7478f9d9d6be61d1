"""A GGUF's linear RoPE scaling read as llama.cpp's loader reads it (``llama_model::load_hparams``):
``rope.scaling.type`` defaults to "linear", the factor is ``rope.scaling.factor`` or else the older
``rope.scale_linear``, and no factor, a factor of 1 or the type "none" means no scaling. Until the
forty-fifth session kvlens read a factor only beside an explicit "linear" type, so a file with the
factor alone (or the older key) ran unscaled where llama.cpp scales. The logits test checks the
factor alone against transformers' float64 forward of the scaled model."""

from __future__ import annotations

import pytest
from bounds import f32_forward_tol
from test_gemma3 import IDS, WINDOW, float64_logits
from test_model_checks_edges import gemma_meta  # noqa: F401
from tiny_models import write_gemma3

import kvlens
from kvlens.models.config import ModelLoadError
from kvlens.models.gguf_loader import config_from_gguf

TYPE, FACTOR, OLD = "gemma3.rope.scaling.type", "gemma3.rope.scaling.factor", "gemma3.rope.scale_linear"
LINEAR4 = {"rope_type": "linear", "factor": 4.0}


@pytest.mark.parametrize(
    "keys, want",
    [
        ({FACTOR: 4.0}, LINEAR4),  # the type left out reads as linear
        ({OLD: 4.0}, LINEAR4),  # the older key
        ({TYPE: "linear", OLD: 4.0}, LINEAR4),
        ({FACTOR: 4.0, OLD: 2.0}, LINEAR4),  # the newer key wins
        ({TYPE: "linear", FACTOR: 4.0}, LINEAR4),
        ({TYPE: "none", FACTOR: 4.0}, None),  # llama.cpp: "never scale if scaling type is none"
        ({TYPE: "linear"}, None),  # no factor: a scale of 1
        ({FACTOR: 1.0}, None),
        ({}, None),
    ],
)
def test_the_scaling_a_gguf_states(gemma_meta, keys, want):  # noqa: F811
    assert config_from_gguf(gemma_meta | keys).rope_scaling == want


@pytest.mark.parametrize("key", [FACTOR, OLD])
@pytest.mark.parametrize("value", [0.0, -2.0])
def test_a_factor_that_is_not_positive_is_refused_by_its_key(gemma_meta, key, value):  # noqa: F811
    with pytest.raises(ModelLoadError) as e:
        config_from_gguf(gemma_meta | {key: value}, "g.gguf")
    assert str(e.value).startswith(f"g.gguf: {key} must be > 0")


def test_a_factor_without_a_type_scales_as_transformers_does(tmp_path):
    hf, path = write_gemma3(
        tmp_path / "f.gguf", sliding_window=WINDOW, global_rope=LINEAR4, meta={FACTOR: 4.0}
    )
    llm = kvlens.load(path, kv="f32", weights="f32", attn_backend="torch")
    ref = float64_logits(hf, IDS)
    assert (llm.logits(IDS).double() - ref).abs().max().item() <= f32_forward_tol(llm.config, ref)

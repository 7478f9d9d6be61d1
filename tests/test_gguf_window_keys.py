"""A GGUF's ``attention.sliding_window`` of 0, read as llama.cpp reads it: no window at all (its loaders
window only where the key is above 0). kvlens refused 0 as a count below 1. A Gemma-3 file without a
window runs every layer as a global layer (its base, its scaling), which the test checks against
transformers' float64 forward of the same weights with every layer ``full_attention``."""

from __future__ import annotations

import gguf
import pytest
import transformers as tf
from bounds import f32_forward_tol
from test_bad_input_models import rewrite_gguf
from test_gemma3 import IDS, WINDOW, float64_logits
from test_model_checks_edges import gemma_meta  # noqa: F401
from tiny_models import write_gemma3

import kvlens
from kvlens.models.config import ModelLoadError
from kvlens.models.gguf_loader import config_from_gguf

KEY = "gemma3.attention.sliding_window"


def test_a_window_of_zero_is_no_window(gemma_meta):  # noqa: F811
    cfg = config_from_gguf(gemma_meta | {KEY: 0})
    assert cfg.sliding_window is None
    assert cfg.layer_windows == (None, None)
    assert config_from_gguf(gemma_meta | {KEY: 3}).layer_windows == (3, 3)  # 2 layers: both local


def test_a_negative_window_is_refused_by_its_key(gemma_meta):  # noqa: F811
    with pytest.raises(ModelLoadError) as e:
        config_from_gguf(gemma_meta | {KEY: -1}, "g.gguf")
    assert str(e.value) == f"g.gguf: {KEY} must be ≥ 0, got -1"


def test_gemma3_without_a_window_runs_every_layer_as_global(tmp_path):
    hf, path = write_gemma3(tmp_path / "w.gguf", sliding_window=WINDOW)
    path = rewrite_gguf(path, tmp_path / "w0.gguf", meta={KEY: (0, gguf.GGUFValueType.UINT32)})
    config = hf.config.to_dict() | {"layer_types": ["full_attention"] * hf.config.num_hidden_layers}
    ref_model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**config)).float().eval()
    ref_model.load_state_dict(hf.state_dict())
    ref = float64_logits(ref_model, IDS)
    llm = kvlens.load(path, kv="f32", weights="f32", attn_backend="torch")
    assert (llm.logits(IDS).double() - ref).abs().max().item() <= f32_forward_tol(llm.config, ref)
    # the reference differs from the windowed model, so the check above can fail
    assert (float64_logits(hf, IDS) - ref).abs().max().item() > 100 * f32_forward_tol(llm.config, ref)

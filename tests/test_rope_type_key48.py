"""RoPE scaling named by the key's older name, ``type`` (as transformers still reads it): the model's
frequencies, not only the config, follow it. The forty-eighth session's mutation run found that
dropping the ``type`` fallback in the transformer passed every test (only the config reading had one)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from bounds import f32_forward_tol
from tiny_models import write_hf

import kvlens

IDS = [5, 17, 200, 33, 41, 9, 128, 77, 64, 3, 250, 199, 8, 90, 91, 92, 7, 6, 5, 4] * 4  # past 64 positions
PARAMS = {
    # low_freq_factor 2, not Llama-3.1's 1, so that old / lo and old * lo differ (head_dim 16: the
    # wavelengths 6.3, 24, 94, ... against the bands' edges 64 / 8 and 64 / 2)
    "llama3": {
        "factor": 8.0,
        "low_freq_factor": 2.0,
        "high_freq_factor": 8.0,
        "original_max_position_embeddings": 64,
    },
    "linear": {"factor": 4.0},
}


@pytest.mark.parametrize("scaling_key", ["rope_type", "type"])
@pytest.mark.parametrize("kind", ["llama3", "linear"])
def test_rope_scaling_under_either_key_matches_transformers(tmp_path, scaling_key, kind):
    written = write_hf("llama", tmp_path)
    ref_config = copy.deepcopy(written.config)
    ref_config.rope_parameters = {"rope_type": kind, "rope_theta": 50000.0, **PARAMS[kind]}
    ref = type(written)(ref_config).eval()
    ref.load_state_dict(written.state_dict())  # the same weights; RoPE buffers from ref_config
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rope_parameters"]  # the older form: rope_scaling beside rope_theta
    config |= {"rope_theta": 50000.0, "rope_scaling": {scaling_key: kind, **PARAMS[kind]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = kvlens.load(str(tmp_path), kv="f32", weights="f32", attn_backend="torch")
    assert llm.config.rope_scaling[scaling_key] == kind
    with torch.no_grad():
        want = ref.double()(torch.tensor([IDS])).logits[0]
    out = llm.logits(IDS).double()
    assert (out - want).abs().max().item() <= f32_forward_tol(llm.config, want)

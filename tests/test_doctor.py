"""``kvlens lab doctor`` finds what was planted in a tiny random model: an outlier K channel in one
layer, a large constant key offset (k_proj bias) in another, and reports their measured cost."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import hf_config, write_tokenizer_json

from kvlens.kv.recipe import parse_recipe
from kvlens.lab.doctor import DoctorConfig, main, run_doctor


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    import transformers as tf

    out = tmp_path_factory.mktemp("doctor") / "hf"
    cfg = hf_config("qwen2")  # q/k/v biases; 2 heads, 1 KV head: head_dim 32, every kind applies
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 2, 1, 32
    torch.manual_seed(4)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
        # layer 0: K channel 5 (and its RoPE partner 21) carries 40x the others
        model.model.layers[0].self_attn.k_proj.weight[5] *= 40.0
        # layer 1: a large constant key offset in the slow RoPE channels (12-15, 28-31), which RoPE
        # barely turns over 64 positions (Qwen2's rope_theta 1e6)
        model.model.layers[1].self_attn.k_proj.bias[12:16] = 30.0
        model.model.layers[1].self_attn.k_proj.bias[28:32] = 30.0
    out.mkdir(parents=True)
    model.save_pretrained(out)
    write_tokenizer_json(out)
    corpus = out.parent / "corpus.txt"
    corpus.write_text(" ".join(f"the {w} in a tin" for w in range(300)))
    return out, corpus


def test_doctor_finds_the_planted_outlier_and_offset(planted, tmp_path, capsys):
    model, corpus = planted
    r = run_doctor(DoctorConfig(model=str(model), corpus=str(corpus), ctx=64, kld_budget=0.01))
    kinds = {(f.kind, f.layer) for f in r.findings}
    assert ("outlier-k", 0) in kinds
    assert ("offset-k", 1) in kinds
    assert ("offset-k", 0) not in kinds and not any(k == "outlier-v" for k, _ in kinds)
    # the offset sits in a few channels, so layer 1 also shows them as outliers (a true signature)
    outlier = next(f for f in r.findings if f.kind == "outlier-k" and f.layer == 0)
    assert "channel 5" in outlier.detail or "channel 21" in outlier.detail
    for f in r.findings:
        if f.layer is not None:
            assert set(f.kld) == {"q8", "q4h"} and all(v >= 0 for v in f.kld.values())
    assert len(parse_recipe(r.recipe, "doctor").layers) == 2
    main(
        DoctorConfig(model=str(model), corpus=str(corpus), ctx=64),
        json_out=True,
        report=str(tmp_path / "rep"),
    )
    data = json.loads(capsys.readouterr().out)
    assert {f["kind"] for f in data["findings"]} >= {"outlier-k", "offset-k"}
    assert (tmp_path / "rep" / "doctor.md").exists() and (tmp_path / "rep" / "recipe.json").exists()

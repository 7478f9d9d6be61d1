"""An HF checkpoint stored in bf16 or f16 (as most published ones are) loads into f32 weights and
matches transformers' float64 forward over the same stored values. Every other HF test saves f32, so
a loader that kept the file's dtype passed them all (the forty-third session's mutation run)."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
import transformers
from bounds import f32_forward_tol
from test_models import IDS, float64_logits
from tiny_models import write_hf

import kvlens


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_checkpoint_loads_as_f32(tmp_path, arch, dtype):
    model = write_hf(arch, tmp_path / "f32")
    half = copy.deepcopy(model).to(dtype)
    half.save_pretrained(tmp_path / "half")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "f32" / name, tmp_path / "half" / name)
    llm = kvlens.load(tmp_path / "half", kv="f32", attn_backend="torch")
    w = llm.model.w
    assert {t.dtype for t in (w.embed, w.norm, w.layers[0].wqkv, w.layers[0].attn_norm)} == {torch.float32}
    # transformers reading the stored half values into float64 (a half model's own .double() would
    # keep its RoPE frequencies rounded to half as well)
    wide = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "half", dtype=torch.float64)
    assert torch.equal(wide.model.embed_tokens.weight, half.model.embed_tokens.weight.double())
    ref = float64_logits(wide, IDS)
    assert (llm.logits(IDS).double() - ref).abs().max().item() <= f32_forward_tol(llm.config, ref)
    assert not torch.equal(half.model.embed_tokens.weight.double(), model.model.embed_tokens.weight.double())

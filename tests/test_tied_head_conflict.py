"""A tied config (``tie_word_embeddings: true``) whose checkpoint also holds an ``lm_head.weight``: a
head equal to the embedding loads tied (one copy); a head that differs is refused, since the readers
disagree (transformers 5 runs the stored head with a warning, 4.x overwrote it with the embedding) and
kvlens used to run the embedding without a word. Untied, the same file runs the stored head, as
transformers does. The reference is transformers reading the files in float64."""

from __future__ import annotations

import json

import pytest
import torch
from bounds import f32_forward_tol
from safetensors.torch import load_file, save_file
from test_models import IDS, float64_logits
from tiny_models import write_hf

import kvlens
from kvlens.models.config import ModelLoadError


def with_stored_head(out, head_from_embed) -> tuple[torch.Tensor, torch.Tensor]:
    """A tied tiny Qwen2 in ``out`` plus a shard holding ``lm_head.weight = head_from_embed(embed)``;
    returns the stored head and the tied model's own float64 logits (the embedding as the head)."""
    tied = write_hf("qwen2", out)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in index["weight_map"]
    embed = load_file(out / index["weight_map"]["model.embed_tokens.weight"])["model.embed_tokens.weight"]
    head = head_from_embed(embed).contiguous()
    save_file({"lm_head.weight": head}, out / "head.safetensors", metadata={"format": "pt"})
    index["weight_map"]["lm_head.weight"] = "head.safetensors"
    index_path.write_text(json.dumps(index))
    return head, float64_logits(tied, IDS)


def hf_logits(path) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0]


def untie(path) -> None:
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(config))


def test_a_stored_head_equal_to_the_embedding_keeps_the_model_tied(tmp_path):
    _, tied_ref = with_stored_head(tmp_path, torch.clone)
    llm = kvlens.load(tmp_path, kv="f32", attn_backend="torch")
    assert llm.config.tied_embeddings and llm.model.w.lm_head is llm.model.w.embed
    ref = hf_logits(tmp_path)
    assert torch.equal(ref, tied_ref)
    assert (llm.logits(IDS).double() - ref).abs().max().item() <= f32_forward_tol(llm.config, ref)


def test_a_stored_head_that_differs_is_refused_then_runs_once_untied(tmp_path):
    gen = torch.Generator().manual_seed(7)
    head, tied_ref = with_stored_head(tmp_path, lambda e: e + 1e-2 * torch.randn(e.shape, generator=gen))
    with pytest.raises(ModelLoadError) as refused:
        kvlens.load(tmp_path, kv="f32")
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'config.json'}: tie_word_embeddings is true, but the checkpoint")
    assert "lm_head.weight that differs from model.embed_tokens.weight" in message

    untie(tmp_path)
    llm = kvlens.load(tmp_path, kv="f32", attn_backend="torch")
    assert not llm.config.tied_embeddings and torch.equal(llm.model.w.lm_head, head)
    ref = hf_logits(tmp_path)
    tol = f32_forward_tol(llm.config, ref)
    assert (llm.logits(IDS).double() - ref).abs().max().item() <= tol
    assert (tied_ref - ref).abs().max().item() > 100 * tol  # running the embedding instead is far off

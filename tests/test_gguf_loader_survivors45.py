"""The GGUF loader's behaviours that the forty-fifth session's mutation run of ``gguf_loader.py`` found
unasserted (436 mutants; docs/testing.md): llama.cpp's RoPE base when the file states none, the model's
name, the file named in a refusal of an inconsistent header, the vocabulary size taken from the token
list, the header fields kept out of the metadata, a dequantized tensor's dtype and ownership, and the
words of two refusals. Expected values are written by hand or read off the file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from test_gguf_tensors45 import files  # noqa: F401
from test_model_checks_edges import gemma_meta  # noqa: F401
from tiny_models import write_out

from kvlens.models.config import ModelLoadError
from kvlens.models.gguf_loader import config_from_gguf, dequantize_tensor, open_gguf


def test_the_rope_base_defaults_to_llama_cpps(gemma_meta):  # noqa: F811
    meta = {k: v for k, v in gemma_meta.items() if k != "gemma3.rope.freq_base"}
    assert gemma_meta["gemma3.rope.freq_base"] == 1e6
    assert config_from_gguf(meta).rope_theta == 10000.0  # llama_model::load_hparams: 10000.0f


def test_the_name_is_the_files_general_name(gemma_meta):  # noqa: F811
    meta = {k: v for k, v in gemma_meta.items() if k != "general.name"}
    assert config_from_gguf(meta | {"general.name": "Tiny Gemma"}).name == "Tiny Gemma"
    assert config_from_gguf(meta).name == ""


def test_an_inconsistent_header_is_refused_with_the_files_name(gemma_meta):  # noqa: F811
    with pytest.raises(ModelLoadError) as e:
        config_from_gguf(gemma_meta | {"gemma3.attention.head_count_kv": 3}, "g.gguf")  # 2 heads
    assert str(e.value).startswith("g.gguf: inconsistent model config: ")


def test_the_vocabulary_size_falls_back_to_the_token_list_only(gemma_meta):  # noqa: F811
    meta = {k: v for k, v in gemma_meta.items() if k != "gemma3.vocab_size"}
    assert config_from_gguf(meta).vocab == len(gemma_meta["tokenizer.ggml.tokens"])
    for tokens in ("abc", [], None):
        with pytest.raises(ModelLoadError) as e:
            config_from_gguf(meta | {"tokenizer.ggml.tokens": tokens}, "g.gguf")
        assert str(e.value) == "g.gguf lacks gemma3.vocab_size and tokenizer.ggml.tokens"


def test_the_headers_own_fields_are_not_metadata(files):  # noqa: F811
    reader, meta = open_gguf(files["mistral"][2])
    assert {k for k in reader.fields if k.startswith("GGUF.")} == {
        "GGUF.version",
        "GGUF.tensor_count",
        "GGUF.kv_count",
    }
    assert not any(k.upper().startswith("GGUF.") for k in meta)
    assert meta["general.architecture"] == "llama"


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        open_gguf(tmp_path / "nope.gguf")
    assert str(e.value) == f"model file not found: {tmp_path / 'nope.gguf'}"


def test_a_dequantized_tensor_is_float32_in_its_own_memory(tmp_path):
    half = (np.arange(12, dtype=np.float32).reshape(3, 4) / 8).astype(np.float16)
    w = gguf.GGUFWriter(str(tmp_path / "h.gguf"), "llama")
    w.add_tensor("a", half)  # stored F16, shape [3, 4]
    w.add_tensor("b", np.ones((2, 4), np.float32))
    write_out(w)
    reader, _ = open_gguf(tmp_path / "h.gguf")
    for t, want in zip(reader.tensors, (half.astype(np.float32), np.ones((2, 4), np.float32)), strict=True):
        got = dequantize_tensor(t)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got, torch.from_numpy(want))
        assert not np.shares_memory(got.numpy(), t.data)  # not a view of the file's memory map
        got += 1  # writable


def test_an_unsupported_tensor_type_is_named(files, monkeypatch):  # noqa: F811
    def refuse(data, qtype):
        raise NotImplementedError(f"no dequantization for {qtype.name}")

    monkeypatch.setattr("gguf.quants.dequantize", refuse)
    reader, _ = open_gguf(files["mistral"][2])
    t = reader.tensors[0]
    with pytest.raises(ModelLoadError) as e:
        dequantize_tensor(t)
    kind = t.tensor_type.name
    assert str(e.value) == f"tensor {t.name}: unsupported tensor type {kind} (no dequantization for {kind})"

"""The model loaders' and the input checks' words and edges that the forty-third session's mutation
run of ``checks.py`` and ``models/`` found unasserted (docs/testing.md): the layer span a header and
its tensors disagree on, Gemma-3's keys read or refused by their exact names, the 27B's attention
scale, an HF checkpoint that ties its head without saying so, and the exact messages of ``read_json``,
``check_url``, ``check_list`` and ``check_finite_fields``. Expected strings are written by hand."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_bad_input_special_files import refusal
from tiny_models import write_gemma3, write_hf

import kvlens
from kvlens.checks import check_finite_fields, check_list, check_url, read_json
from kvlens.models.config import ModelConfig, ModelLoadError
from kvlens.models.gguf_loader import config_from_gguf, open_gguf
from kvlens.models.weights import check_structure, expected_tensors

SMALL = ModelConfig("llama", n_layers=2, hidden=8, n_heads=2, n_kv_heads=1, head_dim=4, ffn=8, vocab=10)


@pytest.mark.parametrize(
    "extra, span",
    [((2, 3), "2..3"), ((5,), "5"), ((3, 5), "[3, 5]"), ((2, 3, 4), "2..4"), ((7, 2), "[2, 7]")],
)
def test_the_layers_a_header_leaves_out_are_named_as_a_run_or_a_list(extra, span):
    found = dict(expected_tensors(SMALL)[0])
    found |= {f"model.layers.{i}.mlp.up_proj.weight": (8, 8) for i in extra}
    with pytest.raises(ModelLoadError) as e:
        check_structure(SMALL, found)
    assert str(e.value) == (
        f"the file holds tensors of layer(s) {span} but n_layers = 2 (layers 0..1); "
        "the header and the tensors disagree"
    )


@pytest.fixture(scope="module")
def gemma_meta(tmp_path_factory) -> dict:
    _, path = write_gemma3(tmp_path_factory.mktemp("g") / "g.gguf", n_layers=2)
    return open_gguf(path)[1]


@pytest.mark.parametrize("key", ["gemma3.attn_logit_softcapping", "gemma3.final_logit_softcapping"])
def test_either_softcapping_key_is_refused_by_name(gemma_meta, key):
    with pytest.raises(ModelLoadError, match=f"^g.gguf: {key} is set; kvlens does not implement"):
        config_from_gguf(gemma_meta | {key: 30.0}, "g.gguf")


def test_gemma3_local_rope_base_is_read_from_its_key(gemma_meta):
    assert config_from_gguf(gemma_meta).rope_local_theta == 10000.0  # llama.cpp's fixed value
    assert config_from_gguf(gemma_meta | {"gemma3.rope.freq_base_swa": 5e4}).rope_local_theta == 5e4
    with pytest.raises(ModelLoadError, match="gemma3.rope.freq_base_swa must be > 0"):
        config_from_gguf(gemma_meta | {"gemma3.rope.freq_base_swa": -1.0})


def test_only_the_62_layer_gemma3_scales_attention_by_hidden_over_heads(gemma_meta):
    """llama.cpp: 1/sqrt(hidden / n_heads) for Gemma-3 27B (62 layers), 1/sqrt(head_dim) otherwise."""
    hidden, heads = gemma_meta["gemma3.embedding_length"], gemma_meta["gemma3.attention.head_count"]
    cfg = config_from_gguf(gemma_meta | {"gemma3.block_count": 62})
    assert cfg.query_pre_attn_scalar == hidden / heads and cfg.attn_scale == (hidden / heads) ** -0.5
    for layers in (61, 63, 2):
        assert config_from_gguf(gemma_meta | {"gemma3.block_count": layers}).query_pre_attn_scalar is None


def test_an_untied_config_without_a_head_ties_it(tmp_path):
    """Some checkpoints tie the head without saying so: no lm_head.weight with tie_word_embeddings
    false loads as tied (the embedding serves as the head), not refused as missing."""
    write_hf("qwen2", tmp_path / "tied")  # tied: it holds no lm_head.weight
    shutil.copytree(tmp_path / "tied", tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    said, unsaid = (kvlens.load(tmp_path / d, kv="f32") for d in ("tied", "m"))
    assert unsaid.config.tied_embeddings and unsaid.model.w.lm_head is unsaid.model.w.embed
    ids = [5, 17, 200, 33]
    assert (unsaid.logits(ids) - said.logits(ids)).abs().max().item() == 0.0


def test_read_json_names_the_file_and_what_it_should_be(tmp_path):
    def read_recipe(path):
        return read_json(path, ValueError, "KV recipe")

    def read_plain(path):
        return read_json(path, ValueError)

    assert str(refusal(read_recipe, tmp_path)) == f"cannot read KV recipe {tmp_path}: Is a directory"
    assert str(refusal(read_plain, tmp_path)) == f"cannot read {tmp_path}: Is a directory"
    assert (
        str(refusal(read_recipe, Path("/dev/zero"))) == "KV recipe /dev/zero is a device, not a regular file"
    )
    bad = tmp_path / "bad.json"
    bad.write_text('{"a" 1}')
    assert (
        str(refusal(read_plain, bad))
        == f"{bad} is not valid JSON: Expecting ':' delimiter (line 1, column 6)"
    )


def test_a_url_is_http_or_https_with_a_host():
    for url in ("http://127.0.0.1:8000", "https://example.org/v1"):
        assert check_url(url) == url
    for url in ("ftp://example.org", "https://", "127.0.0.1:8000", "httpx://example.org"):
        with pytest.raises(ValueError, match="expected an http:// or https:// URL with a host"):
            check_url(url)


def test_a_list_check_says_what_it_takes():
    with pytest.raises(TypeError) as e:
        check_list(None, "ctx", int)  # not optional unless asked
    assert str(e.value) == "ctx must be a list of whole numbers, got NoneType None"
    with pytest.raises(TypeError) as e:
        check_list(5, "kv", str, split=lambda s: s.split(","))
    assert str(e.value) == "kv must be a list of names or a comma-separated string, got int 5"
    assert check_list(None, "ctx", int, optional=True) is None


def test_a_nonfinite_field_is_named_as_its_option():
    with pytest.raises(ValueError) as e:
        check_finite_fields(SimpleNamespace(kld_budget=math.nan), "kld_budget", above=0.0)
    assert str(e.value).startswith("--kld-budget must be a finite number")
    with pytest.raises(ValueError, match="--kld-budget must be > 0"):
        check_finite_fields(SimpleNamespace(kld_budget=0.0), "kld_budget", above=0.0)


def test_an_ignored_tensor_does_not_end_the_check_of_the_others():
    """Old HF checkpoints carry ``rotary_emb.inv_freq`` (recomputed here): it is passed over, and every
    tensor after it is still checked."""
    found = {"model.layers.0.self_attn.rotary_emb.inv_freq": (2,), **expected_tensors(SMALL)[0]}
    check_structure(SMALL, found)  # the ignored one alone is fine
    with pytest.raises(ModelLoadError, match="unexpected tensor 'model.extra.weight' in the checkpoint"):
        check_structure(SMALL, found | {"model.extra.weight": (8,)})
    wrong = found | {"model.norm.weight": (9,)}
    with pytest.raises(
        ModelLoadError, match=r"'model.norm.weight' has shape \(9,\), the config implies \(8,\)"
    ):
        check_structure(SMALL, wrong)


@pytest.mark.parametrize("n_missing, tail", [(1, ""), (2, " (and 1 more)"), (4, " (and 3 more)")])
def test_missing_tensors_are_named_with_how_many_more(n_missing, tail):
    required = expected_tensors(SMALL)[0]
    gone = list(required)[-n_missing:]
    found = {k: v for k, v in required.items() if k not in gone}
    with pytest.raises(ModelLoadError) as e:
        check_structure(SMALL, found, label=lambda name: f"<{name}>")
    assert str(e.value) == f"tensor '<{gone[0]}>' is missing from the checkpoint{tail}"


def test_a_rope_scaling_that_is_not_a_mapping_is_named():
    with pytest.raises(ModelLoadError) as e:
        dataclasses.replace(SMALL, rope_scaling=[1])
    assert str(e.value) == "inconsistent model config: rope_scaling must be a mapping, got list"

"""Model files that do not add up are refused with an error naming the key or tensor, never run.

Each case starts from a valid tiny checkpoint (tests/tiny_models.py) and breaks one thing: the GGUF
is rewritten field by field and tensor by tensor (:func:`rewrite_gguf`), the HF directory gets a
one-key change to config.json or a re-saved safetensors file.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tiny_models import write_gguf, write_hf

from kvlens.models.config import ModelConfig, ModelLoadError, check_readable
from kvlens.models.loader import load_model
from kvlens.models.tokenizer import TokenizerError

GT = gguf.GGUFValueType
DROP = None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A valid tiny Mistral (2 layers, 4/2 heads, head 16, vocab 320) as an HF dir, its model, and a GGUF."""
    root = tmp_path_factory.mktemp("bad_models")
    model = write_hf("mistral", root / "hf")
    gguf_path = write_gguf(model, "mistral", root / "ok.gguf")
    return root / "hf", model, gguf_path


def rewrite_gguf(src: Path, dst: Path, meta: dict | None = None, tensors: dict | None = None) -> Path:
    """Copy a GGUF with metadata keys set (``key: (value, GGUFValueType)``) or dropped (``key: DROP``)
    and tensors replaced (``name: float32 array``, numpy shape) or dropped (``name: DROP``)."""
    meta, tensors = meta or {}, tensors or {}
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in meta:
            continue
        sub = field.types[-1] if field.types[0] == GT.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for key, value in meta.items():
        if value is not DROP:
            w.add_key_value(key, *value)
    for t in r.tensors:
        if t.name not in tensors:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, a in tensors.items():
        if a is not DROP:
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def tensor(path: Path, name: str) -> np.ndarray:
    return np.array(next(t for t in gguf.GGUFReader(path).tensors if t.name == name).data)


def refused(path: Path, *needles: str, weights: str = "f32") -> str:
    with pytest.raises(ModelLoadError) as e:
        load_model(path, weights=weights)
    msg = str(e.value)
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_the_unbroken_files_load(tiny):
    hf_dir, _, gguf_path = tiny
    assert load_model(gguf_path).config.n_layers == load_model(hf_dir).config.n_layers == 2


def test_viewed_gguf_reader_reads_what_gguf_reads(tiny):
    """kvlens reads GGUFs through a plain-ndarray view of gguf's memory map (for speed): the same
    fields and tensor bytes as gguf's own reader, no copy of the file, and read-only."""
    from kvlens.models.gguf_loader import gguf_reader_class, read_metadata

    path = tiny[2]
    ours, theirs = gguf_reader_class()(path), gguf.gguf_reader.GGUFReader(path)  # gguf's, unpatched
    assert type(ours.data) is np.ndarray and isinstance(ours.data.base, np.memmap)  # a view, not a copy
    assert not ours.data.flags.writeable and np.array_equal(ours.data, theirs.data)
    assert read_metadata(ours) == read_metadata(theirs)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and np.array_equal(a.data, b.data)
        assert np.shares_memory(a.data, ours.data)


# -- GGUF: the header and the tensors must agree, both ways ------------------------------------------
def test_gguf_header_says_fewer_layers_than_the_file_holds(tiny, tmp_path):
    bad = rewrite_gguf(tiny[2], tmp_path / "b.gguf", meta={"llama.block_count": (1, GT.UINT32)})
    refused(bad, "layer(s) 1", "llama.block_count = 1")


def test_gguf_extra_layer_tensors_are_refused(tiny, tmp_path):
    ok = tiny[2]
    extra = {
        t.name.replace("blk.1.", "blk.2."): np.array(t.data)
        for t in gguf.GGUFReader(ok).tensors
        if "blk.1." in t.name
    }
    refused(rewrite_gguf(ok, tmp_path / "b.gguf", tensors=extra), "layer(s) 2", "llama.block_count = 2")


def test_gguf_header_says_more_layers_than_the_file_holds(tiny, tmp_path):
    bad = rewrite_gguf(tiny[2], tmp_path / "b.gguf", meta={"llama.block_count": (3, GT.UINT32)})
    refused(bad, "'blk.2.attn_norm.weight' is missing")


@pytest.mark.parametrize("weights", ["f32", "auto", "int8"])
def test_gguf_missing_weight_matrix_is_named(tiny, tmp_path, weights):
    bad = rewrite_gguf(tiny[2], tmp_path / "b.gguf", tensors={"blk.1.ffn_up.weight": DROP})
    refused(bad, "'blk.1.ffn_up.weight' is missing", weights=weights)


def test_gguf_wrong_shape_is_refused(tiny, tmp_path):
    down = tensor(tiny[2], "blk.0.ffn_down.weight")  # numpy [hidden 64, ffn 96]
    bad = rewrite_gguf(tiny[2], tmp_path / "b.gguf", tensors={"blk.0.ffn_down.weight": down.T})
    refused(bad, "'blk.0.ffn_down.weight' has shape (96, 64)", "(64, 96)")


@pytest.mark.parametrize("weights", ["f32", "int8"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_gguf_non_finite_weights_are_refused(tiny, tmp_path, weights, bad):
    """A NaN or Inf weight would run and put NaN into every logit (or K/V) it reaches."""
    for name in ("blk.1.attn_v.weight", "output_norm.weight"):
        a = tensor(tiny[2], name).copy()
        a.flat[a.size // 2] = bad
        path = rewrite_gguf(tiny[2], tmp_path / f"{name}.gguf", tensors={name: a})
        refused(path, f"'{name}' holds NaN or Inf values", weights=weights)


def test_hf_non_finite_weights_are_refused(tiny, tmp_path):
    state = dict(tiny[1].state_dict())
    for i, (name, bad) in enumerate(
        [("model.embed_tokens.weight", math.nan), ("model.layers.0.input_layernorm.weight", math.inf)]
    ):
        t = state[name].clone()
        t.view(-1)[7] = bad
        for dtype in (torch.float32, torch.bfloat16):
            poisoned = {**state, name: t.to(dtype)}
            refused(resaved(tiny, tmp_path / f"{i}{dtype}", poisoned), f"'{name}' holds NaN or Inf values")


def test_gguf_unknown_or_unused_tensors_are_refused(tiny, tmp_path):
    bias = np.zeros(64, np.float32)
    refused(
        rewrite_gguf(tiny[2], tmp_path / "a.gguf", tensors={"blk.0.attn_output.bias": bias}),
        "unexpected tensor 'blk.0.attn_output.bias'",
    )
    refused(
        rewrite_gguf(tiny[2], tmp_path / "b.gguf", tensors={"mystery.weight": bias}),
        "unexpected tensor 'mystery.weight'",
    )


def test_gguf_vocab_must_match_the_embedding(tiny, tmp_path):
    bad = rewrite_gguf(tiny[2], tmp_path / "b.gguf", meta={"llama.vocab_size": (300, GT.UINT32)})
    refused(bad, "llama.vocab_size = 300 but tokenizer.ggml.tokens lists 320 tokens")
    # without the key the token list sizes the vocabulary, and the embedding's 320 rows are refused
    fields = gguf.GGUFReader(tiny[2]).fields
    short = {
        "llama.vocab_size": DROP,
        "tokenizer.ggml.tokens": (fields["tokenizer.ggml.tokens"].contents()[:300], GT.ARRAY, GT.STRING),
        "tokenizer.ggml.token_type": (
            fields["tokenizer.ggml.token_type"].contents()[:300],
            GT.ARRAY,
            GT.INT32,
        ),
    }
    refused(
        rewrite_gguf(tiny[2], tmp_path / "s.gguf", meta=short), "token_embd.weight", "(320, 64)", "(300, 64)"
    )


BAD_GGUF_META = [
    ("llama.block_count", (0, GT.UINT32), "llama.block_count must be ≥ 1, got 0"),
    ("llama.block_count", ("2", GT.STRING), "llama.block_count must be an integer"),
    ("llama.block_count", (2.0, GT.FLOAT32), "llama.block_count must be an integer"),
    ("llama.block_count", (-2, GT.INT32), "llama.block_count must be ≥ 1, got -2"),
    ("llama.block_count", DROP, "lacks llama.block_count"),
    ("llama.attention.head_count", (0, GT.UINT32), "llama.attention.head_count must be ≥ 1"),
    (
        "llama.attention.head_count_kv",
        (3, GT.UINT32),
        "n_heads (llama.attention.head_count)=4 is not a multiple",
    ),
    ("llama.attention.key_length", (32, GT.UINT32), "llama.attention.value_length=16 differs"),
    ("llama.attention.value_length", (32, GT.UINT32), "llama.attention.value_length=32 differs"),
    ("llama.rope.freq_base", (math.nan, GT.FLOAT32), "llama.rope.freq_base must be a finite number"),
    ("llama.rope.freq_base", (-1.0, GT.FLOAT32), "llama.rope.freq_base must be > 0"),
    ("llama.attention.layer_norm_rms_epsilon", (0.0, GT.FLOAT32), "layer_norm_rms_epsilon must be > 0"),
    ("llama.attention.layer_norm_rms_epsilon", (math.inf, GT.FLOAT32), "must be a finite number"),
    ("llama.context_length", (0, GT.UINT32), "llama.context_length must be ≥ 1"),
    # llama.cpp refuses a file without either (no default of its own): kvlens did run one, with 1e-5 / 4096
    ("llama.context_length", DROP, "lacks llama.context_length"),
    ("llama.attention.layer_norm_rms_epsilon", DROP, "lacks llama.attention.layer_norm_rms_epsilon"),
    ("llama.rope.scaling.type", ("yarn", GT.STRING), "rope.scaling.type='yarn' is not supported"),
]


@pytest.mark.parametrize(
    ("key", "value", "needle"), BAD_GGUF_META, ids=[f"{k}={v and v[0]}" for k, v, _ in BAD_GGUF_META]
)
def test_gguf_bad_metadata_names_the_key(tiny, tmp_path, key, value, needle):
    refused(rewrite_gguf(tiny[2], tmp_path / "b.gguf", meta={key: value}), needle)


def test_gguf_odd_head_size(tiny, tmp_path):
    meta = {"llama.attention.key_length": (15, GT.UINT32), "llama.attention.value_length": (15, GT.UINT32)}
    refused(
        rewrite_gguf(tiny[2], tmp_path / "b.gguf", meta=meta),
        "head_dim (llama.attention.key_length)=15 must be even",
    )


def test_gguf_hidden_not_divisible_by_heads(tiny, tmp_path):
    meta = {
        "llama.attention.key_length": DROP,
        "llama.attention.value_length": DROP,
        "llama.attention.head_count": (3, GT.UINT32),
        "llama.attention.head_count_kv": (3, GT.UINT32),
    }
    refused(
        rewrite_gguf(tiny[2], tmp_path / "b.gguf", meta=meta),
        "llama.embedding_length=64 is not a multiple of llama.attention.head_count=3",
    )


def test_unreadable_paths_are_called_what_they_are(tmp_path, monkeypatch):
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(ModelLoadError, match="is a directory, expected a file"):
        check_readable(tmp_path / "dir.gguf")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    refused(empty, "is empty (0 bytes)")
    locked = tmp_path / "locked.gguf"
    locked.write_bytes(b"GGUF")

    def deny(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(locked))

    monkeypatch.setattr("builtins.open", deny)
    msg = refused(locked, "cannot open", "Permission denied")
    assert "corrupt" not in msg


# -- HF config.json: each bad value is named by its key ------------------------------------------------
def llama3_scaling(low: float, high: float) -> dict:
    """An HF llama3 rope_scaling whose every other number is valid."""
    return {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": 64,
    }


BAD_HF_CONFIG = [
    ("num_hidden_layers", 0, "num_hidden_layers must be ≥ 1, got 0"),
    ("num_hidden_layers", -1, "num_hidden_layers must be ≥ 1, got -1"),
    ("num_hidden_layers", "2", "num_hidden_layers must be an integer, got str"),
    ("num_hidden_layers", 2.5, "num_hidden_layers must be an integer, got float"),
    ("num_hidden_layers", True, "num_hidden_layers must be an integer, got bool"),
    ("num_hidden_layers", None, "lacks num_hidden_layers"),
    ("hidden_size", [64], "hidden_size must be an integer, got list"),
    ("num_attention_heads", 0, "num_attention_heads must be ≥ 1"),
    (
        "num_key_value_heads",
        3,
        "n_heads (num_attention_heads)=4 is not a multiple of n_kv_heads (num_key_value_heads)=3",
    ),
    ("head_dim", 15, "head_dim=15 must be even"),
    ("intermediate_size", -96, "intermediate_size must be ≥ 1"),
    ("vocab_size", 0, "vocab_size must be ≥ 1"),
    ("rope_theta", "10000", "rope_theta must be a number, got str"),
    ("rope_theta", math.nan, "rope_theta must be a finite number"),
    ("rope_theta", -5.0, "rope_theta must be > 0"),
    ("rms_norm_eps", 0, "rms_norm_eps must be > 0"),
    ("rms_norm_eps", math.inf, "rms_norm_eps must be a finite number"),
    ("max_position_embeddings", 0, "max_position_embeddings must be ≥ 1"),
    ("tie_word_embeddings", "yes", "tie_word_embeddings must be true or false"),
    ("rope_scaling", "linear", "rope_scaling must be a JSON object"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "unsupported rope scaling 'yarn'"),
    ("rope_scaling", {"rope_type": "linear"}, "rope_scaling.factor must be a number"),
    ("rope_scaling", {"rope_type": "linear", "factor": 0}, "rope_scaling.factor must be > 0"),
    (
        "rope_scaling",
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
        "rope_scaling.high_freq_factor",
    ),
    # llama3's smoothing divides by high - low: equal factors are refused like reversed ones
    ("rope_scaling", llama3_scaling(low=4.0, high=4.0), "high_freq_factor must be > low_freq_factor"),
    ("rope_scaling", llama3_scaling(low=5.0, high=4.0), "high_freq_factor must be > low_freq_factor"),
    ("model_type", "gpt2", "unsupported model_type 'gpt2'"),
]


def hf_copy(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    ("key", "value", "needle"), BAD_HF_CONFIG, ids=[f"{k}={v!r}"[:40] for k, v, _ in BAD_HF_CONFIG]
)
def test_hf_bad_config_value_names_the_key(tiny, tmp_path, key, value, needle):
    refused(hf_copy(tiny[0], tmp_path / "m", **{key: value}), needle)


def test_hf_config_that_is_not_an_object_or_not_json(tiny, tmp_path):
    d = hf_copy(tiny[0], tmp_path / "m")
    (d / "config.json").write_text("[1, 2]")
    refused(d, "must hold a JSON object, got list")
    (d / "config.json").write_text("{not json")
    refused(d, "is not valid JSON")


def resaved(tiny, dst: Path, state: dict[str, torch.Tensor], **config_changes) -> Path:
    """The tiny HF dir with its safetensors replaced by one file holding ``state``."""
    d = hf_copy(tiny[0], dst, **config_changes)
    for f in [*d.glob("*.safetensors"), d / "model.safetensors.index.json"]:
        f.unlink()
    save_file({k: v.contiguous() for k, v in state.items()}, str(d / "model.safetensors"))
    return d


def test_hf_header_says_fewer_layers_than_the_weights_hold(tiny, tmp_path):
    state = tiny[1].state_dict()
    refused(resaved(tiny, tmp_path / "m", state, num_hidden_layers=1), "layer(s) 1", "num_hidden_layers = 1")


def test_hf_missing_extra_misshapen_and_mistyped_tensors(tiny, tmp_path):
    state = dict(tiny[1].state_dict())
    missing = {k: v for k, v in state.items() if k != "model.layers.0.self_attn.v_proj.weight"}
    refused(resaved(tiny, tmp_path / "a", missing), "'model.layers.0.self_attn.v_proj.weight' is missing")
    extra = {**state, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}
    refused(resaved(tiny, tmp_path / "b", extra), "unexpected tensor 'model.layers.0.self_attn.o_proj.bias'")
    wrong = {**state, "model.norm.weight": torch.ones(65)}
    refused(resaved(tiny, tmp_path / "c", wrong), "'model.norm.weight' has shape (65,)", "(64,)")
    ints = {**state, "model.norm.weight": torch.ones(64, dtype=torch.int64)}
    refused(resaved(tiny, tmp_path / "d", ints), "'model.norm.weight'", "dtype I64")
    # named as ignored: old checkpoints' rotary inv_freq buffers load
    ignored = {**state, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    assert load_model(resaved(tiny, tmp_path / "e", ignored)).config.n_layers == 2


@pytest.mark.parametrize("rows", [300, 319])  # 319: one id, the last, with no embedding row
def test_hf_tokenizer_larger_than_the_vocabulary(tiny, tmp_path, rows):
    state = dict(tiny[1].state_dict())
    state = {
        k: (v[:rows] if k in ("model.embed_tokens.weight", "lm_head.weight") else v) for k, v in state.items()
    }
    refused(
        resaved(tiny, tmp_path / "m", state, vocab_size=rows),
        "the tokenizer has 320 tokens",
        f"(vocab_size, embedding rows) is {rows}",
    )


def test_model_config_checks_the_python_api_too():
    good = dict(arch="llama", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=96, vocab=320)
    assert ModelConfig(**good).group == 2
    for change in [
        {"n_layers": 0},
        {"n_kv_heads": 3},
        {"head_dim": 15},
        {"rms_eps": math.nan},
        {"vocab": True},
        {"sliding_window": 0},
        {"embed_scale": 0.0},  # set by the loaders (Gemma: sqrt(hidden)), checked all the same
        {"embed_scale": math.inf},
    ]:
        with pytest.raises(ModelLoadError):
            ModelConfig(**{**good, **change})


def test_gguf_tokenizer_metadata_is_checked(tiny, tmp_path):
    bos = rewrite_gguf(tiny[2], tmp_path / "a.gguf", meta={"tokenizer.ggml.bos_token_id": (9999, GT.UINT32)})
    refused_tokenizer(bos, "the BOS token id 9999 is outside the tokenizer's 320 tokens")
    no_tokens = rewrite_gguf(tiny[2], tmp_path / "b.gguf", meta={"tokenizer.ggml.tokens": DROP})
    refused_tokenizer(no_tokens, "lacks tokenizer.ggml.tokens")


def test_hf_tokenizer_files_are_checked(tiny, tmp_path):
    d = hf_copy(tiny[0], tmp_path / "a")
    (d / "tokenizer.json").write_text("{}")
    refused_tokenizer(d, "tokenizer.json is not a valid tokenizer file")
    d = hf_copy(tiny[0], tmp_path / "b")
    (d / "tokenizer_config.json").write_text("{oops")
    refused_tokenizer(d, "tokenizer_config.json is not valid JSON")
    d = hf_copy(tiny[0], tmp_path / "c", eos_token_id=4000)
    (d / "tokenizer_config.json").write_text("{}")
    refused_tokenizer(d, "the EOS token id 4000 is outside")


def refused_tokenizer(path: Path, needle: str) -> None:
    with pytest.raises(TokenizerError, match=re.escape(needle)):
        load_model(path)

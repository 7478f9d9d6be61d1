"""Which tensors a model file may hold beyond those its config implies (the forty-fifth session).

llama.cpp refuses a GGUF file that holds a tensor its graph does not create ("wrong number of
tensors"): its llama graph reads ``rope_freqs`` (Llama-3's RoPE scaling), its qwen2, qwen3 and gemma3
graphs do not. kvlens had one list for every source: it took ``…rotary_emb.inv_freq`` (an old HF
checkpoint's leftover) in a GGUF, and applied a ``rope_freqs`` tensor in a qwen2/qwen3 GGUF or an HF
directory, where no reference reader would. Also the contract of ``load_gguf_tensors`` called
directly, and the file name in Gemma-3's local RoPE base refusal. Expected words are written by hand.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_bad_input_models import DROP, rewrite_gguf
from test_model_checks_edges import gemma_meta  # noqa: F401
from tiny_models import write_gguf, write_hf

import kvlens
from kvlens.models.config import ModelLoadError
from kvlens.models.gguf_loader import config_from_gguf, load_gguf_tensors, open_gguf
from kvlens.models.loader import load_model

FREQS = np.linspace(1.0, 4.0, 8, dtype=np.float32)  # Mistral's head_dim 16 → 8 frequencies, none of them 1
FREQS_QWEN3 = np.linspace(1.0, 4.0, 16, dtype=np.float32)  # head_dim 32: a shape the check would take


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Tiny Mistral (GGUF arch llama) and Qwen3 models as HF directories and GGUFs."""
    root = tmp_path_factory.mktemp("t45")
    out = {}
    for arch in ("mistral", "qwen3"):
        model = write_hf(arch, root / arch)
        out[arch] = (root / arch, model, write_gguf(model, arch, root / f"{arch}.gguf"))
    return out


@pytest.mark.parametrize("name", ["blk.0.rotary_emb.inv_freq", "blk.1.attn.rotary_emb.inv_freq"])
def test_an_hf_leftover_tensor_in_a_gguf_is_refused(files, tmp_path, name):
    bad = rewrite_gguf(files["mistral"][2], tmp_path / "b.gguf", tensors={name: FREQS})
    with pytest.raises(ModelLoadError) as e:
        load_model(bad)
    assert str(e.value) == f"unexpected tensor {name!r} in the checkpoint (llama does not use it)"


def test_rope_freqs_in_a_qwen3_gguf_is_refused(files, tmp_path):
    bad = rewrite_gguf(files["qwen3"][2], tmp_path / "b.gguf", tensors={"rope_freqs.weight": FREQS_QWEN3})
    with pytest.raises(ModelLoadError) as e:
        load_model(bad)
    assert str(e.value) == "unexpected tensor 'rope_freqs.weight' in the checkpoint (qwen3 does not use it)"


def test_rope_freqs_in_a_llama_gguf_divides_the_frequencies(files, tmp_path):
    """llama.cpp's llama graph divides each RoPE frequency by its factor, whatever the header says."""
    plain = load_model(files["mistral"][2])
    scaled = load_model(
        rewrite_gguf(files["mistral"][2], tmp_path / "s.gguf", tensors={"rope_freqs.weight": FREQS})
    )
    assert torch.equal(scaled.weights.rope_freq_factors, torch.from_numpy(FREQS))
    assert plain.weights.rope_freq_factors is None


def _hf_dir_with(src, dst, tensors: dict):
    """A copy of the HF directory ``src`` with ``tensors`` added to its first shard (the index left out,
    so every shard is read)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors.index.json":
            (dst / f.name).write_bytes(f.read_bytes())
    shard = sorted(dst.glob("*.safetensors"))[0]
    save_file(load_file(shard) | tensors, shard)
    return dst


def test_rope_freqs_in_an_hf_directory_is_refused(files, tmp_path):
    dst = _hf_dir_with(files["mistral"][0], tmp_path / "hf", {"rope_freqs": torch.from_numpy(FREQS)})
    with pytest.raises(ModelLoadError) as e:
        kvlens.load(str(dst))
    assert str(e.value) == "unexpected tensor 'rope_freqs' in the checkpoint (mistral does not use it)"


def test_an_hf_leftover_tensor_in_an_hf_directory_is_still_ignored(files, tmp_path):
    src = files["mistral"][0]
    leftover = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.from_numpy(FREQS)}
    dst = _hf_dir_with(src, tmp_path / "hf", leftover)
    got = load_model(dst).weights
    want = load_model(src).weights
    assert got.rope_freq_factors is None
    assert torch.equal(got.layers[0].wqkv, want.layers[0].wqkv)


def test_load_gguf_tensors_leaves_out_what_it_is_told_and_what_it_does_not_know(files, tmp_path):
    path = rewrite_gguf(files["mistral"][2], tmp_path / "u.gguf", tensors={"blk.0.mystery.weight": FREQS})
    reader, meta = open_gguf(path)
    cfg = config_from_gguf(meta, str(path))
    skip = {"model.layers.1.mlp.up_proj.weight", "model.norm.weight"}
    got = load_gguf_tensors(reader, cfg, skip=skip)
    every = load_gguf_tensors(reader, cfg)
    assert set(every) - set(got) == skip
    assert "blk.0.mystery.weight" not in every and None not in every
    hf = dict(files["mistral"][1].state_dict())
    for name, t in got.items():  # q/k rows back in HF's order; the rest as stored
        assert torch.equal(t, hf[name].float()), name


def test_a_bad_gemma3_local_rope_base_names_the_file(gemma_meta):  # noqa: F811
    with pytest.raises(ModelLoadError) as e:
        config_from_gguf(gemma_meta | {"gemma3.rope.freq_base_swa": -1.0}, "g.gguf")
    assert str(e.value).startswith("g.gguf: gemma3.rope.freq_base_swa must be > 0")


@pytest.mark.parametrize("experts", [1, 8])  # llama.cpp: any count above 0 builds the experts' graph
def test_a_llama_gguf_with_experts_is_refused_by_its_key(files, experts):
    meta = open_gguf(files["mistral"][2])[1]
    with pytest.raises(ModelLoadError) as e:
        config_from_gguf(meta | {"llama.expert_count": experts}, "m.gguf")
    assert str(e.value) == (
        f"m.gguf: llama.expert_count = {experts}: a mixture-of-experts model; kvlens implements dense models only"
    )
    with pytest.raises(ModelLoadError, match="^m.gguf: llama.expert_count must be an integer"):
        config_from_gguf(meta | {"llama.expert_count": "8"}, "m.gguf")
    assert config_from_gguf(meta | {"llama.expert_count": 0}).n_layers == 2


def test_an_expert_count_in_a_qwen3_gguf_is_ignored_as_llama_cpp_does(files):
    """llama.cpp's qwen3 graph has no experts (Qwen3-MoE is the separate qwen3moe architecture)."""
    meta = open_gguf(files["qwen3"][2])[1]
    assert config_from_gguf(meta | {"qwen3.expert_count": 8}) == config_from_gguf(meta)


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])  # the first stores output.weight, the second not
def test_a_gguf_is_tied_exactly_when_it_has_no_output_weight(files, arch, tmp_path):
    _, model, path = files[arch]
    stored = not model.config.tie_word_embeddings
    assert load_model(path).config.tied_embeddings is (not stored)
    head = model.state_dict()["model.embed_tokens.weight"].numpy()
    flipped = rewrite_gguf(path, tmp_path / "f.gguf", tensors={"output.weight": DROP if stored else head})
    assert load_model(flipped).config.tied_embeddings is stored


def test_a_token_list_shorter_than_the_embedding_is_refused(files, tmp_path):
    """llama.cpp shapes the embedding and the head by the token count; kvlens loaded such a file, and
    the rows past the list could be sampled as ids with no token."""
    ok = files["mistral"][2]
    fields = gguf.GGUFReader(ok).fields
    cut = {
        "tokenizer.ggml.tokens": (
            fields["tokenizer.ggml.tokens"].contents()[:300],
            gguf.GGUFValueType.ARRAY,
            gguf.GGUFValueType.STRING,
        ),
        "tokenizer.ggml.token_type": (
            fields["tokenizer.ggml.token_type"].contents()[:300],
            gguf.GGUFValueType.ARRAY,
            gguf.GGUFValueType.INT32,
        ),
    }
    bad = rewrite_gguf(ok, tmp_path / "short.gguf", meta=cut)
    with pytest.raises(ModelLoadError) as e:
        load_model(bad)
    assert str(e.value) == (
        f"{bad}: llama.vocab_size = 320 but tokenizer.ggml.tokens lists 300 tokens; "
        "a GGUF's embedding has one row per token"
    )

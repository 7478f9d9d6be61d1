"""Tiny random Llama(3-scaled)/Mistral/Qwen2/Qwen3 checkpoints: both formats load and match transformers."""

from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch
from bounds import f32_forward_tol
from ggml_blocks import BLOCK_BYTES, dequantize_blocks
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import write_gguf, write_hf

import kvlens
from kvlens.models.config import ModelLoadError
from kvlens.models.gguf_loader import dequantize_tensor, open_gguf
from kvlens.models.transformer import rms_norm

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
IDS = [5, 17, 200, 33, 41, 9, 128, 77, 64, 3, 250, 199]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    hf = write_hf(arch, root / "hf")
    gguf_path = write_gguf(hf, arch, root / f"{arch}.gguf")
    return arch, root / "hf", gguf_path, float64_logits(hf, IDS), hf


def float64_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' logits in float64 (a copy of the model): the reference for our f32 forward."""
    with torch.no_grad():
        return copy.deepcopy(hf).double()(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_tiny_logits_match_transformers(tiny, fmt):
    arch, hf_dir, gguf_path, ref, _ = tiny
    llm = kvlens.load(hf_dir if fmt == "safetensors" else gguf_path, kv="f32", attn_backend="torch")
    assert llm.config.arch == ("llama" if fmt == "gguf" and arch == "mistral" else arch)
    out = llm.logits(IDS, prefill_chunk=5)
    assert (out.double() - ref).abs().max().item() <= f32_forward_tol(llm.config, ref)


def test_tiny_greedy_matches_transformers(tiny):
    arch, hf_dir, _, _, hf = tiny
    llm = kvlens.load(hf_dir, kv="f32", attn_backend="torch")
    with torch.no_grad():
        ref = hf.generate(torch.tensor([IDS[:4]]), max_new_tokens=6, do_sample=False, eos_token_id=None)[
            0, 4:
        ]
    ours = list(llm.generate_ids(IDS[:4], 6, stop_at_eos=False))
    assert ours == ref.tolist()


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_sliding_window_matches_transformers(tmp_path, backend):
    """Mistral with a window of 4 over 12 tokens: chunked prefill and token-by-token decode."""
    window = 4
    hf = write_hf("mistral", tmp_path / "hf", sliding_window=window)
    ref = float64_logits(hf, IDS)
    llm = kvlens.load(tmp_path / "hf", kv="f32", attn_backend=backend)
    assert llm.config.sliding_window == window
    tol = f32_forward_tol(llm.config, ref)
    cache = llm.new_cache(len(IDS))
    steps = [llm.model.logits(llm.forward([t], cache, i, prefill=i == 0)) for i, t in enumerate(IDS)]
    for out in (llm.logits(IDS, prefill_chunk=5), torch.cat(steps)):
        assert (out.double() - ref).abs().max().item() <= tol
    hf.config.sliding_window = None  # the window is exercised: full causal attention differs
    assert (float64_logits(hf, IDS)[window:] - ref[window:]).abs().max().item() > 100 * tol


def test_sharded_index_was_used(tiny):
    _, hf_dir, *_ = tiny
    assert (hf_dir / "model.safetensors.index.json").is_file()
    assert len(list(hf_dir.glob("*.safetensors"))) > 1


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_quantized_gguf_types_load(tmp_path, qtype):
    """A llama checkpoint stored in each quantized type loads and equals gguf's own dequantization."""
    hf = write_hf("llama", tmp_path / "hf")
    path = write_gguf(hf, "llama", tmp_path / "m.gguf", gguf.GGMLQuantizationType[qtype])
    reader, _ = open_gguf(path)
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    assert t.tensor_type.name == qtype
    w = dequantize_tensor(t)
    src = hf.model.layers[0].mlp.up_proj.weight.detach()
    assert w.shape == src.shape
    tol = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 0.02, "Q4_0": 0.2, "Q4_1": 0.2}[qtype]
    assert (w - src).abs().max().item() < tol * src.abs().max().item() * 4
    kvlens.load(path, kv="f32")  # the whole model loads


@pytest.mark.parametrize("qtype", list(BLOCK_BYTES))
def test_gguf_blocks_decode_like_the_spec(qtype):
    """Random raw blocks of every GGML type the loader reads, against the float64 decoder written from
    llama.cpp's spec (tests/ggml_blocks.py). f16 scales are set finite; everything else is random."""
    kind = gguf.GGMLQuantizationType[qtype]
    size = BLOCK_BYTES[qtype]
    values = 256 if qtype.endswith("_K") else 32
    per_row = 512 // values  # 2 super-blocks or 16 small blocks per row
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(4, per_row, size), dtype=np.uint8)
    f16_at = {"Q6_K": [size - 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q4_1": [0, 2]}.get(qtype, [0])
    for at in f16_at:
        scales = rng.uniform(-0.05, 0.05, size=(4, per_row)).astype(np.float16)
        raw[:, :, at : at + 2] = scales[..., None].view(np.uint8)
    raw = raw.reshape(4, per_row * size)

    class FakeTensor:  # the reader's tensor record: raw bytes, type, GGUF (reversed) shape
        name, tensor_type, data, shape = "t", kind, raw, np.array([512, 4])

    w = dequantize_tensor(FakeTensor)
    want = dequantize_blocks(raw, qtype)
    assert w.shape == (4, 512) and w.dtype == torch.float32
    # llama.cpp decodes in f32: the spec's float64 value rounded once or twice (d·sc·q - dmin·m)
    np.testing.assert_allclose(w.double().numpy(), want, rtol=2**-22, atol=2**-22 * np.abs(want).max())


def test_truncated_gguf_is_a_clear_error(tiny, tmp_path):
    _, _, gguf_path, _, _ = tiny
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(gguf_path.read_bytes()[: gguf_path.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        kvlens.load(bad)


def test_corrupt_safetensors_is_a_clear_error(tiny, tmp_path):
    import shutil

    _, hf_dir, *_ = tiny
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    shard = sorted(bad.glob("*.safetensors"))[0]
    shard.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        kvlens.load(bad)


def test_missing_and_unsupported_models(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        kvlens.load(tmp_path / "nope.gguf")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="unsupported model file"):
        kvlens.load(tmp_path / "weights.bin")
    (tmp_path / "d").mkdir()
    with pytest.raises(ModelLoadError, match="without config.json"):
        kvlens.load(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text('{"model_type": "gpt_neox"}')
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gpt_neox'"):
        kvlens.load(tmp_path / "d")


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40),
    width=st.sampled_from([8, 64, 256, 576, 640]),
    heads=st.integers(1, 4),
    transposed=st.booleans(),
    eps=st.sampled_from([1e-6, 1e-5]),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_is_transformers_rmsnorm_bit_for_bit(rows, width, heads, transposed, eps, scale, seed):
    """``models.transformer.rms_norm`` against transformers' own ``LlamaRMSNorm`` module, bit for bit:
    prefill rows, a decode row, and the head-major views that QK-norm layers pass (a transposed,
    non-contiguous view)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, heads, width, generator=gen) * scale
    if transposed:
        x = x.transpose(0, 1)
    module = LlamaRMSNorm(width, eps=eps)
    with torch.no_grad():
        module.weight.copy_(torch.randn(width, generator=gen))
        want = module(x)
    assert torch.equal(rms_norm(x, module.weight.detach(), eps), want)

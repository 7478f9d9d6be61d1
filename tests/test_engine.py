"""The engine on the real default model: parity with HF transformers, chunking, the q8 cache."""

from __future__ import annotations

import pytest
import torch
from bounds import f32_forward_tol
from conftest import PROMPTS

from kvlens.kv.modes import CacheOptions

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf64_logits(hf_smol):
    """HF transformers' float64 logits per prompt: the independent reference (bounds.f32_forward_tol)."""
    cache = {}

    def get(ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in cache:
            with torch.no_grad():
                cache[key] = hf_smol(torch.tensor([ids])).logits[0]
        return cache[key]

    return get


def assert_f32_close(ours: torch.Tensor, ref64: torch.Tensor, cfg) -> None:
    assert ours.shape == ref64.shape
    err = (ours.double() - ref64).abs().max().item()
    assert err <= f32_forward_tol(cfg, ref64), (err, f32_forward_tol(cfg, ref64))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_f32_logits_equal_float64_hf(smol_f32, hf64_logits, prompt):
    ids = smol_f32.tokenizer.encode(prompt)
    assert_f32_close(smol_f32.logits(ids), hf64_logits(ids), smol_f32.config)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_decode_token_by_token_equals_float64_hf(smol_f32, hf64_logits, backend):
    """The default decode path (numba kernel over an f32 cache, JIT row glue), one token per step."""
    llm = smol_f32.variant(attn_backend=backend)
    ids = llm.tokenizer.encode(PROMPTS[1])
    cache = llm.new_cache(len(ids))
    steps = []
    for pos, tok in enumerate(ids):
        h = llm.forward([tok], cache, pos, prefill=pos == 0)
        steps.append(llm.model.logits(h))
    assert_f32_close(torch.cat(steps), hf64_logits(ids), llm.config)


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_prefill_equals_float64_hf(smol_f32, hf64_logits, chunk):
    ids = smol_f32.tokenizer.encode(PROMPTS[2])
    assert_f32_close(smol_f32.logits(ids, prefill_chunk=chunk), hf64_logits(ids), smol_f32.config)


def test_q8_cache_is_read_and_still_says_paris(smol_f32):
    ids = smol_f32.tokenizer.encode("The capital of France is")
    f32 = smol_f32.logits(ids)
    q8 = smol_f32.logits(ids, kv="q8")
    assert (q8 - f32).abs().max().item() > 1e-3  # the int8 rows really are what attention read
    assert smol_f32.tokenizer.decode([int(q8[-1].argmax())]) == " Paris"


@pytest.mark.parametrize("kv", ["q8", "q8+mirror", "f16", "bf16"])
def test_greedy_paris_every_mode(smol_loaded, kv):
    import kvlens

    llm = kvlens.LLM(smol_loaded, kv=kv, attn_backend="torch")
    assert llm.generate("The capital of France is", max_new_tokens=3).startswith(" Paris")


def test_mirror_prefill_reads_exact_history(smol_f32):
    ids = smol_f32.tokenizer.encode(PROMPTS[0])
    f32 = smol_f32.logits(ids, prefill_chunk=2)
    exact = smol_f32.logits(ids, "q8+mirror", 2, CacheOptions(mirror_prefill="exact"))
    q8rows = smol_f32.logits(ids, "q8+mirror", 2, CacheOptions(mirror_prefill="q8"))
    q8 = smol_f32.logits(ids, kv="q8", prefill_chunk=2)
    assert torch.equal(exact, f32)  # prefill never touched the int8 rows: the same f32 rows, same ops
    assert torch.equal(q8rows, q8)


def test_mirror_decode_reads_int8(smol_f32):
    """q8+mirror: prefill reads the exact copy, so its rows are the f32 prefill's rows; the decode step
    then reads their int8 codes — bit for bit a q8 cache holding quantize(f32 prefill rows)."""
    ids = smol_f32.tokenizer.encode(PROMPTS[0])
    n, cfg = len(ids), smol_f32.config
    mirror, exact = smol_f32.new_cache(n + 1, kv="q8+mirror"), smol_f32.new_cache(n + 1, kv="f32")
    smol_f32.prefill(ids, mirror)
    smol_f32.prefill(ids, exact)
    q8 = smol_f32.new_cache(n + 1, kv="q8")
    for layer in range(cfg.n_layers):
        q8.write(layer, 0, *exact.read(layer, n))
    outs = [smol_f32.forward([ids[-1]], c, n, prefill=False) for c in (mirror, q8, exact)]
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])  # the int8 codes, not the exact copy, were read


def test_kv_bytes_per_token(smol_f32):
    cfg = smol_f32.config
    rows = cfg.n_layers * cfg.n_kv_heads * 2
    ksum = cfg.n_layers * cfg.n_kv_heads * 2 * (cfg.head_dim // 32)  # int8 K's int16 sums per 32 codes
    assert smol_f32.new_cache(32, "q8").bytes_per_token() == rows * (cfg.head_dim + 4) + ksum
    assert smol_f32.new_cache(32, "f16").bytes_per_token() == rows * 2 * cfg.head_dim
    assert smol_f32.new_cache(32, "f32").bytes_per_token() == rows * 4 * cfg.head_dim
    assert (
        smol_f32.new_cache(32, "q8+mirror").bytes_per_token()
        == rows * (cfg.head_dim + 4 + 4 * cfg.head_dim) + ksum
    )


def test_chat_generation_answers(smol_loaded):
    import kvlens

    llm = kvlens.LLM(smol_loaded, kv="q8")
    text = llm.generate("What is the capital of France?", max_new_tokens=24, chat=True)
    assert "Paris" in text


def test_sampling_is_seeded(smol_f32):
    from kvlens import SamplingParams

    p = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7)
    a = smol_f32.generate("Once upon a time", max_new_tokens=8, sampling=p)
    b = smol_f32.generate("Once upon a time", max_new_tokens=8, sampling=p)
    assert a == b


def test_prompt_longer_than_context_is_refused(smol_f32):
    from kvlens.engine.llm import ContextOverflowError

    with pytest.raises(ContextOverflowError, match="context of 8192"):
        smol_f32.logits([1] * (smol_f32.config.max_ctx + 1))


def test_single_token_jit_glue_equals_torch_layer(smol_f32):
    """Decode steps run the layer glue as JIT row ops (models.rowops); the torch layer is the reference.

    f32 cache: with q8 the two paths' last-bit differences could flip a code of the new rows (CPU
    dependent); the glue does not depend on the cache mode. Two f32 passes: twice bounds.f32_forward_tol.
    """
    kv = "f32"
    ids = smol_f32.tokenizer.encode(PROMPTS[0])
    outs = []
    for row_ops in (True, False):
        smol_f32.model.row_ops = row_ops
        try:
            cache = smol_f32.new_cache(len(ids) + 1, kv)
            smol_f32.prefill(ids, cache)
            outs.append(smol_f32.forward([ids[-1]], cache, len(ids), prefill=False))
        finally:
            smol_f32.model.row_ops = True
    assert (outs[0] - outs[1]).abs().max().item() <= 2 * f32_forward_tol(smol_f32.config, outs[1])


@pytest.mark.parametrize("keep", ["keep_recent"])
def test_kept_exact_rows_are_what_decode_reads(smol_f32, keep):
    """With every position kept exact, a q8 cache must read as the f32 one, in prefill and in the
    default (numba) decode step: the kernel cannot serve this option and the torch path must (the
    sink store: tests/test_sink_store.py)."""
    ids = smol_f32.tokenizer.encode(PROMPTS[0])
    n = len(ids)
    outs = []
    for llm, cache in (
        (
            smol_f32.variant(attn_backend="numba"),
            smol_f32.new_cache(n + 1, kv="q8", options=CacheOptions(**{keep: n + 1})),
        ),
        (smol_f32, smol_f32.new_cache(n + 1, kv="f32")),
    ):
        outs.append((llm.prefill(ids, cache), llm.forward([ids[-1]], cache, n, prefill=False)))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])

"""The engine on the real default model: parity with HF transformers, chunking, the q8 cache."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS

from kvlens.kv.modes import CacheOptions

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("prompt", PROMPTS)
def test_f32_logits_equal_hf(smol_f32, hf_smol, prompt):
    ids = smol_f32.tokenizer.encode(prompt)
    ours = smol_f32.logits(ids)
    with torch.no_grad():
        ref = hf_smol(torch.tensor([ids])).logits[0]
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4


def test_decode_token_by_token_equals_full_forward(smol_f32):
    ids = smol_f32.tokenizer.encode(PROMPTS[1])
    full = smol_f32.logits(ids)
    cache = smol_f32.new_cache(len(ids))
    steps = []
    for pos, tok in enumerate(ids):
        h = smol_f32.forward([tok], cache, pos, prefill=pos == 0)
        steps.append(smol_f32.model.logits(h))
    assert (torch.cat(steps) - full).abs().max().item() < 1e-4


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_prefill_equals_unchunked_f32(smol_f32, chunk):
    ids = smol_f32.tokenizer.encode(PROMPTS[2])
    whole = smol_f32.logits(ids, prefill_chunk=len(ids))
    assert (smol_f32.logits(ids, prefill_chunk=chunk) - whole).abs().max().item() < 1e-4


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
    assert (exact - f32).abs().max().item() < 1e-5  # prefill never touched the int8 rows
    assert torch.equal(q8rows, q8)


def test_mirror_decode_reads_int8(smol_f32):
    ids = smol_f32.tokenizer.encode(PROMPTS[0])
    outs = {}
    for kv in ("q8+mirror", "q8", "f32"):
        cache = smol_f32.new_cache(len(ids) + 1, kv=kv)
        smol_f32.prefill(ids, cache)
        outs[kv] = smol_f32.model.logits(smol_f32.forward([ids[-1]], cache, len(ids), prefill=False))
    # the decode step of the mirror mode reads int8 history: different from f32, not from its own exact copy
    assert (outs["q8+mirror"] - outs["f32"]).abs().max().item() > 1e-4


def test_kv_bytes_per_token(smol_f32):
    cfg = smol_f32.config
    rows = cfg.n_layers * cfg.n_kv_heads * 2
    assert smol_f32.new_cache(32, "q8").bytes_per_token() == rows * (cfg.head_dim + 4)
    assert smol_f32.new_cache(32, "f16").bytes_per_token() == rows * 2 * cfg.head_dim
    assert smol_f32.new_cache(32, "f32").bytes_per_token() == rows * 4 * cfg.head_dim
    assert smol_f32.new_cache(32, "q8+mirror").bytes_per_token() == rows * (
        cfg.head_dim + 4 + 4 * cfg.head_dim
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


@pytest.mark.parametrize("kv", ["f32", "q8"])
def test_single_token_jit_glue_equals_torch_layer(smol_f32, kv):
    """Decode steps run the layer glue as JIT row ops (models.rowops); the torch layer is the reference."""
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
    assert (outs[0] - outs[1]).abs().max().item() < 1e-4 * outs[1].abs().max().item()

"""The transformer's less-travelled paths: the batched decode rows through the torch glue (what runs
off the CPU) against transformers, RoPE tables grown by a batch, and a forward pass resumed at a
layer (the lab's sensitivity runs) equal to the whole pass."""

from __future__ import annotations

import pytest
import torch
from bounds import f32_forward_tol
from test_gemma3 import IDS, WINDOW, float64_logits
from tiny_models import write_gemma3, write_hf

import kvlens
from kvlens.engine.attention import make_attend


def decode_row_logits(llm, seqs: list[list[int]]) -> torch.Tensor:
    """Each sequence but its last token prefilled in its own cache, then one batched decode step of
    the last tokens (Transformer.decode_rows, the scheduler's step): logits [B, vocab]."""
    caches = [llm.new_cache(len(ids)) for ids in seqs]
    for cache, ids in zip(caches, seqs, strict=True):
        llm.forward(ids[:-1], cache, 0)
    attends = [make_attend(c, False, llm.attn_backend, llm.config.layer_windows) for c in caches]
    with torch.inference_mode():
        hidden = llm.model.decode_rows(
            torch.tensor([ids[-1] for ids in seqs]), [len(ids) - 1 for ids in seqs], attends
        )
        return llm.model.logits_rows(hidden)


def test_gemma3_rows_through_the_torch_glue_match_transformers(tmp_path):
    """Without the JIT glue (row_ops off, as on a GPU) each row still takes its own layer's RoPE table
    (windowed layers: the local base) and the sandwich norms."""
    hf, path = write_gemma3(tmp_path / "tiny.gguf", sliding_window=WINDOW)
    ref = float64_logits(hf, IDS)
    llm = kvlens.load(path, kv="f32", weights="f32", attn_backend="torch")
    llm.model.row_ops = False
    other = IDS[::-1]
    out = decode_row_logits(llm, [IDS, other]).double()
    want = torch.stack([ref[-1], float64_logits(hf, other)[-1]])
    assert (out - want).abs().max().item() <= f32_forward_tol(llm.config, want)


@pytest.fixture(scope="module")
def long_qwen(tmp_path_factory):
    """A tiny Qwen2 with a 512-token context (its RoPE tables start at 256 rows)."""
    root = tmp_path_factory.mktemp("qwen-512")
    write_hf("qwen2", root, max_position_embeddings=512)
    return kvlens.load(str(root), kv="f32", weights="f32", attn_backend="numba")


def test_batch_rows_grow_the_rope_tables_for_their_furthest_position(long_qwen):
    """A batch whose longest sequence decodes one past every table row so far grows the tables for
    that row, and each row equals that sequence's own decode step bit for bit."""
    llm = long_qwen
    g = torch.Generator().manual_seed(3)
    long_ids = torch.randint(3, llm.config.vocab, (302,), generator=g).tolist()
    short_ids = long_ids[:4]
    table = llm.model.ropes[0]
    rows = decode_row_logits(llm, [long_ids, short_ids])  # the 301-token prefill grows rows to 301
    assert table.cos.shape[0] > 301
    for b, ids in enumerate((long_ids, short_ids)):
        cache = llm.new_cache(len(ids))
        llm.forward(ids[:-1], cache, 0)
        alone = llm.model.logits(llm.forward(ids[-1:], cache, len(ids) - 1, prefill=False))[0]
        assert torch.equal(rows[b], alone), f"row {b}"


def test_a_pass_resumed_at_a_layer_is_the_whole_pass(long_qwen):
    """forward_from(x, first=k) with the residual that entered layer k is the whole pass's output; the
    residuals on_input sees are the embeddings at layer 0 and each layer's input after."""
    llm, ids = long_qwen, torch.tensor([5, 17, 200, 33, 41, 9])
    model, n_layers = llm.model, llm.config.n_layers

    def run(x, first=0):
        seen = {}
        attend = make_attend(llm.new_cache(len(ids), "f32"), True, "torch")
        with torch.inference_mode():
            out = model.forward_from(x, 0, attend, first, lambda i, h: seen.__setitem__(i, h.clone()))
        return out, seen

    with torch.inference_mode():
        emb = model.embed(ids)
    whole, inputs = run(emb)
    assert sorted(inputs) == list(range(n_layers)) and torch.equal(inputs[0], emb)
    for k in range(1, n_layers):
        resumed, seen = run(inputs[k], first=k)
        assert sorted(seen) == list(range(k, n_layers))
        assert torch.equal(resumed, whole), f"resumed at layer {k}"

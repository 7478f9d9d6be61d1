"""Sparse decode: block bounds, selection, and the kernels that read only the selected blocks."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from bounds import attention_bound
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.engine.attention import make_attend, select_blocks
from kvlens.kernels.cpu import decode_attention
from kvlens.kernels.reference import blocks_to_mask, reference_attention
from kvlens.kv.blocks import PROBES, SparseConfig, probe_positions, probe_scores, quest_scores, top_blocks
from kvlens.kv.cache import BLOCK, KVCache
from kvlens.kv.modes import MODES, CacheOptions


def filled_cache(n_kv=2, d=32, length=300, mode="q8", seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(n_kv, length, d, generator=g), torch.randn(n_kv, length, d, generator=g)
    c = KVCache(1, n_kv, d, length, MODES[mode], options=CacheOptions(track_blocks=True))
    for s in range(0, length, 70):  # several writes, some straddling blocks
        c.write(0, s, k[:, s : s + 70], v[:, s : s + 70])
    return c


def test_bounds_are_min_max_of_dequantized_keys():
    c = filled_cache()
    kd, _ = c.read(0, 300)
    for b in range(-(-300 // BLOCK)):
        rows = kd[:, b * BLOCK : (b + 1) * BLOCK]
        assert torch.equal(c.bounds.kmin[0][:, b], rows.amin(1))
        assert torch.equal(c.bounds.kmax[0][:, b], rows.amax(1))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([1, 3, 4]), st.integers(33, 200))
def test_quest_bound_never_below_true_block_max(seed, group, length):
    c = filled_cache(length=length, seed=seed)
    q = torch.randn(2 * group, 32, generator=torch.Generator().manual_seed(seed + 1))
    nb = -(-length // BLOCK)
    bound = quest_scores(q, c.bounds.kmin[0][:, :nb], c.bounds.kmax[0][:, :nb])
    kd, _ = c.read(0, length)
    scores = torch.einsum("kgd,knd->kgn", q.view(2, group, 32), kd).amax(1)  # max over the group
    for b in range(nb):
        true_max = scores[:, b * BLOCK : (b + 1) * BLOCK].amax(1)
        assert (bound[:, b] >= true_max - 1e-4 * true_max.abs().clamp(min=1)).all()


@pytest.mark.parametrize("method", ["quest", "probe"])
def test_planted_key_block_is_selected(method):
    c = filled_cache(length=640)
    q = torch.randn(2, 32, generator=torch.Generator().manual_seed(5))
    k, v = c.read(0, 640)
    pos = 11 * BLOCK + 4  # a probe position (every 4th key of a block)
    k[:, pos] = 10 * torch.sign(q)  # far above any N(0,1) key's score
    fresh = KVCache(1, 2, 32, 640, MODES["q8"], options=CacheOptions(track_blocks=True))
    fresh.write(0, 0, k, v)
    blocks = select_blocks(
        q, fresh, 0, 640, SparseConfig(method, budget=4 * BLOCK, dense_layers=0, min_ctx=0)
    )
    assert blocks.shape == (2, 4)
    assert all(11 in row for row in blocks.tolist())
    assert all(row[0] == 0 and row[-1] == 19 for row in blocks.tolist())  # sink and most recent kept


def test_selection_is_deterministic_and_sorted():
    c = filled_cache(length=1000)
    q = torch.randn(6, 32, generator=torch.Generator().manual_seed(2))
    cfg = SparseConfig("quest", budget=0.25, dense_layers=0, min_ctx=0)
    a, b = select_blocks(q, c, 0, 1000, cfg), select_blocks(q, c, 0, 1000, cfg)
    assert torch.equal(a, b)
    assert a.shape[1] == cfg.budget_blocks(1000, BLOCK) == 8
    assert (a.diff(dim=1) > 0).all()


def test_budget_covering_everything_means_dense():
    assert top_blocks(torch.randn(2, 10), 10) is None
    c = filled_cache(length=300)
    q = torch.randn(4, 32)
    all_blocks = torch.arange(10, dtype=torch.int32).expand(2, 10)
    dense = decode_attention(q, c.k[0], c.v[0], 300)
    assert torch.equal(decode_attention(q, c.k[0], c.v[0], 300, blocks=all_blocks), dense)


def test_probe_scores_use_eight_spaced_keys():
    keys = torch.zeros(1, 2 * BLOCK, 4)
    keys[0, 5, 0] = 100.0  # not a probe position: invisible to the probe
    keys[0, BLOCK + 8, 0] = 1.0
    pos = probe_positions(2 * BLOCK, BLOCK)
    assert len(pos) == 2 * PROBES and pos[:3].tolist() == [0, 4, 8]
    s = probe_scores(torch.tensor([[1.0, 0, 0, 0]]), keys[:, pos])
    assert s.tolist() == [[0.0, 1.0]]


def test_probe_scores_take_the_max_over_the_gqa_group():
    """Two query heads share one KV head: the block's score is the larger of their two maxima (by
    hand: the probe key at position 8 is (2, 0, 0, 0); the heads see +2 and -2)."""
    keys = torch.zeros(1, BLOCK, 4)
    keys[0, 8, 0] = 2.0
    q = torch.tensor([[-1.0, 0, 0, 0], [1.0, 0, 0, 0]])
    assert probe_scores(q, keys[:, probe_positions(BLOCK, BLOCK)]).tolist() == [[2.0]]


@pytest.mark.parametrize(
    "budget,length,blocks",
    [
        (0.5, 1000, 16),
        (0.25, 1000, 8),
        (1, 1000, 2),
        (40, 1000, 2),
        (65, 1000, 3),
        (0.01, 1000, 2),
        (2048, 100, 64),
    ],
)
def test_budget_blocks_by_hand(budget, length, blocks):
    """A budget below 1 is a share of the context, from 1 up a token count; rounded up to whole blocks
    of 32, never fewer than 2 (the sink block and the most recent)."""
    assert SparseConfig("quest", budget=budget).budget_blocks(length, BLOCK) == blocks


def test_sparse_applies_from_the_first_sparse_layer_and_the_minimum_context_inclusive():
    cfg = SparseConfig("quest", dense_layers=2, min_ctx=1024)
    assert cfg.applies(2, 1024) and cfg.applies(5, 4096)
    assert not cfg.applies(1, 4096) and not cfg.applies(2, 1023)


@pytest.mark.parametrize("mode", ["q8", "f32", "f16"])
def test_sparse_kernel_equals_masked_float64_reference(mode):
    c = filled_cache(n_kv=2, d=64, length=500, mode=mode)
    q = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    blocks = torch.tensor([[0, 2, 3, 9, 15], [0, 1, 7, 14, 15]], dtype=torch.int32)
    kd, vd = c.read(0, 500)
    mask = blocks_to_mask(blocks, 500, BLOCK)
    ref = reference_attention(q[:, None].double(), kd.double(), vd.double(), kv_mask=mask)[:, 0]
    for n_splits in (None, 1, 3):
        out = decode_attention(q, c.k[0], c.v[0], 500, n_splits=n_splits, blocks=blocks)
        np.testing.assert_allclose(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_sparse_triton_kernel_interpreted():
    # conftest sets TRITON_INTERPRET=1 before triton is imported (no GPU in CI)
    from kvlens.kernels.gpu import decode_attention_triton

    c = filled_cache(n_kv=2, d=32, length=200)
    q = torch.randn(6, 32)
    blocks = torch.tensor([[0, 2, 6], [0, 5, 6]], dtype=torch.int32)
    kd, vd = c.read(0, 200)
    ref = reference_attention(
        q[:, None].double(), kd.double(), vd.double(), kv_mask=blocks_to_mask(blocks, 200, BLOCK)
    )[:, 0]
    out = decode_attention_triton(q, c.k[0], c.v[0], 200, blocks=blocks)
    np.testing.assert_allclose(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_bad_sparse_options():
    with pytest.raises(ValueError, match="unknown sparse method"):
        SparseConfig("oracle")
    with pytest.raises(ValueError, match="budget must be > 0"):
        SparseConfig("quest", budget=0)


@pytest.mark.slow
def test_engine_sparse_decode(smol_f32):
    """One decode step of the real model with sparse attention, checked call by call.

    Every layer's attention call runs the numba kernel and the torch path on the SAME cache (both
    write the same new K/V row, then read), and each is compared with a float64 masked reference
    over the dequantized rows; the bound is bounds.attention_bound's f32 worst case (x2 headroom).
    Comparing end-to-end logits of two backends instead would depend on the CPU: their f32 rounding
    flips int8 codes of later layers' new rows, and the flips cascade.
    """
    ids = smol_f32.tokenizer.encode("The history of the city begins in antiquity. " * 40)[:400]
    sparse = SparseConfig("quest", 64, 2, 0)
    llm = smol_f32.variant(kv="q8", sparse=sparse, attn_backend="numba")
    cache = llm.new_cache(len(ids) + 1)
    llm.prefill(ids[:-1], cache)
    numba_attend = make_attend(cache, False, "numba", None, sparse)
    torch_attend = make_attend(cache, False, "torch", None, sparse)
    n_sparse = []

    def attend(layer, q, k, v, start):
        out_numba = numba_attend(layer, q, k, v, start)
        out_torch = torch_attend(layer, q, k, v, start)
        end = start + 1
        blocks = select_blocks(q[:, 0], cache, layer, end, sparse) if sparse.applies(layer, end) else None
        kd, vd = cache.read(layer, end)
        mask = None if blocks is None else blocks_to_mask(blocks, end, BLOCK)
        n_sparse.append(0 if mask is None else int(mask.sum(1).max()))
        ref = reference_attention(q.double(), kd.double(), vd.double(), kv_mask=mask)[:, 0]
        bound = 2 * attention_bound(q[:, 0], kd, vd, mask)
        for out in (out_numba, out_torch):
            err = (out[:, 0].double() - ref).abs()
            assert (err <= bound).all(), (layer, (err / bound).max().item())
        return out_numba

    with torch.inference_mode():
        llm.model.forward(torch.tensor([ids[-1]]), len(ids) - 1, attend)
    # two dense layers, then the sink block and the newest (partial) block: 32 + (n - 1) % 32 + 1 keys
    assert n_sparse[:2] == [0, 0] and set(n_sparse[2:]) == {BLOCK + (len(ids) - 1) % BLOCK + 1}


@pytest.mark.slow
def test_engine_sparse_budget_covering_context_is_dense(smol_f32):
    ids = smol_f32.tokenizer.encode("The history of the city begins in antiquity. " * 40)[:400]
    outs = {}
    for name, sparse in (("dense", None), ("full", SparseConfig("quest", 10_000, 2, 0))):
        llm = smol_f32.variant(kv="q8", sparse=sparse, attn_backend="numba")
        cache = llm.new_cache(len(ids) + 1)
        llm.prefill(ids, cache)
        outs[name] = llm.model.logits(llm.forward([ids[-1]], cache, len(ids), prefill=False))
    assert torch.equal(outs["full"], outs["dense"])  # the same kernel over the same blocks: bit-equal

"""The compiled Quest selection (kernels.quest) against the torch selection (kv.blocks) and an
independent float64 reference written out here.

Two kinds of data:

* integer-valued query and bounds (|values| ≤ 4, head_dim ≤ 256): every product and sum is an exact
  small integer in f32, whatever the summation order, so the selections must be EQUAL — and equal
  scores are common, which exercises the tie rule (the lower block index wins);
* random floats: the two implementations sum in different orders, so blocks whose float64 scores
  lie within the f32 rounding of the cut may rank differently; everything else must match, and
  every selection must be a correct top-n of the float64 scores up to that rounding.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.engine.attention import make_attend, select_blocks
from kvlens.kernels.quest import quest_select
from kvlens.kernels.reference import blocks_to_mask, reference_attention
from kvlens.kv.blocks import SparseConfig, quest_scores, top_blocks
from kvlens.kv.cache import BLOCK, KVCache
from kvlens.kv.modes import MODES, CacheOptions

U32 = 2.0**-24
GROUPS = [1, 3, 4, 8]
HEAD_DIMS = [64, 128, 256]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny problems run on one thread


def reference_scores(q, kmin, kmax, nb):
    """Float64 Quest bound per (KV head, block): max over the group of Σ_d max(q_d kmin_d, q_d kmax_d)."""
    n_kv, hd = kmin.shape[0], kmin.shape[2]
    qg = q.double().view(n_kv, -1, 1, hd)  # [KV, G, 1, d]
    lo, hi = kmin[:, None, :nb].double(), kmax[:, None, :nb].double()  # [KV, 1, nb, d]
    return torch.maximum(qg * lo, qg * hi).sum(-1).amax(1)  # [KV, nb]


def reference_selection(scores64, n_select):
    """Blocks 0 and nb-1, plus the n_select-2 best middle blocks by (score desc, index asc); sorted."""
    nb = scores64.shape[1]
    rows = []
    for row in scores64.tolist():
        middle = sorted(range(1, nb - 1), key=lambda b: (-row[b], b))[: n_select - 2]
        rows.append(sorted([0, nb - 1, *middle]))
    return rows


def integer_case(seed, n_kv, group, hd, nb, spare=3, span=4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-span, span + 1, (n_kv * group, hd), generator=g).float()
    a = torch.randint(-span, span + 1, (2, n_kv, nb + spare, hd), generator=g).float()
    return q, a.amin(0), a.amax(0)  # spare blocks past nb: garbage the selection must not read


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n_kv=st.integers(1, 3),
    group=st.sampled_from(GROUPS),
    hd=st.sampled_from(HEAD_DIMS),
    nb=st.integers(1, 70),
    extra=st.integers(0, 72),
    span=st.sampled_from([1, 4]),
)
def test_integer_bounds_select_exactly_like_torch_and_float64(seed, n_kv, group, hd, nb, extra, span):
    q, kmin, kmax = integer_case(seed, n_kv, group, hd, nb, span=span)
    n_select = 2 + extra
    got = quest_select(q, kmin, kmax, nb, n_select)
    torch_sel = top_blocks(quest_scores(q, kmin[:, :nb], kmax[:, :nb]), n_select)
    if n_select >= nb:  # the budget covers every block (1 block included): dense
        assert got is None and torch_sel is None
        return
    want = reference_selection(reference_scores(q, kmin, kmax, nb), n_select)
    assert got.dtype == torch.int32 and got.shape == (n_kv, n_select)
    assert got.tolist() == want
    assert torch_sel.tolist() == want


def test_ties_go_to_the_lower_block_index():
    q = torch.ones(4, 64)
    kmin = torch.zeros(2, 12, 64)
    kmax = torch.zeros(2, 12, 64)
    kmax[0, [3, 5, 7, 9]] = 1.0  # four equal best blocks, room for two: 3 and 5
    kmax[1, 8] = 2.0  # one best block, then ten tied at 0: the lowest, 1
    for sel in (quest_select(q, kmin, kmax, 12, 4), top_blocks(quest_scores(q, kmin, kmax), 4)):
        assert sel.tolist() == [[0, 3, 5, 11], [0, 1, 8, 11]]


def test_nan_bound_ranks_last_like_torch():
    q, kmin, kmax = integer_case(7, 1, 4, 64, 10)
    kmax[0, 4, 0] = float("nan")  # one block's bound is NaN for every query head with q_0 > 0
    q[:, 0] = 1.0
    kmax[0, 4, 1:] = 100.0  # would be the best block otherwise
    sel = quest_select(q, kmin, kmax, 10, 9)
    assert 4 not in sel[0].tolist()
    assert torch.equal(sel, top_blocks(quest_scores(q, kmin[:, :10], kmax[:, :10]), 9))
    q[1, 5] = float("nan")  # one query head of the group NaN: every block's bound is NaN, all tie
    for sel in (
        quest_select(q, kmin, kmax, 10, 5),
        top_blocks(quest_scores(q, kmin[:, :10], kmax[:, :10]), 5),
    ):
        assert sel.tolist() == [[0, 1, 2, 3, 9]]


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_float_bounds_match_torch_up_to_rounding_at_the_cut(group, hd):
    g = torch.Generator().manual_seed(group * 1000 + hd)
    n_kv, nb = 2, 300
    q = torch.randn(n_kv * group, hd, generator=g)
    centre = torch.randn(n_kv, nb, hd, generator=g)
    kmin, kmax = (
        centre - torch.rand(n_kv, nb, hd, generator=g),
        centre + torch.rand(n_kv, nb, hd, generator=g),
    )
    s64 = reference_scores(q, kmin, kmax, nb)
    # |f32 sum - exact| ≤ 2hd·u·Σ|terms| for either summation order; two orders differ by twice that
    abs_terms = (
        q.double().abs().view(n_kv, group, 1, hd) * torch.maximum(kmin.abs(), kmax.abs()).double()[:, None]
    )
    tol = 2 * 2 * hd * U32 * abs_terms.sum(-1).amax(1)
    for n_select in (2, 3, 40, nb - 1):
        got = quest_select(q, kmin, kmax, nb, n_select)
        ref = top_blocks(quest_scores(q, kmin, kmax), n_select)
        for h in range(n_kv):
            chosen, other = set(got[h].tolist()), set(ref[h].tolist())
            assert {0, nb - 1} <= chosen and len(chosen) == n_select
            middle = s64[h, 1 : nb - 1]
            cut = middle.sort(descending=True).values[n_select - 3] if n_select > 2 else None
            for b in chosen ^ other:  # a disagreement only where the float64 score is at the cut
                assert abs(s64[h, b] - cut) <= 2 * tol[h, b], (h, b)
            worst_in = min(s64[h, b] + tol[h, b] for b in chosen - {0, nb - 1}) if n_select > 2 else None
            best_out = max(s64[h, b] - tol[h, b] for b in set(range(1, nb - 1)) - chosen)
            assert worst_in is None or worst_in >= best_out


def test_growing_context_and_changing_shapes_reuse_scratch_correctly():
    """The per-thread scratch grows and changes shape between calls: results must not depend on it."""
    cases = [(2, 4, 128, 40), (2, 4, 128, 200), (3, 1, 64, 10), (2, 4, 128, 90), (8, 4, 128, 512)]
    for seed, (n_kv, group, hd, nb) in enumerate(cases):
        q, kmin, kmax = integer_case(seed, n_kv, group, hd, nb)
        want = reference_selection(reference_scores(q, kmin, kmax, nb), 8)
        assert quest_select(q, kmin, kmax, nb, 8).tolist() == want


def test_a_budget_of_every_block_is_dense():
    """The contract the engine relies on: None (dense attention) once n_select reaches the block count."""
    q, kmin, kmax = integer_case(0, 2, 2, 64, 10)
    assert quest_select(q, kmin, kmax, 10, 10) is None and quest_select(q, kmin, kmax, 10, 12) is None
    assert quest_select(q, kmin, kmax, 10, 9).shape == (2, 9)


def test_bad_arguments():
    q, kmin, kmax = integer_case(0, 2, 2, 64, 10)
    with pytest.raises(ValueError, match="n_select"):
        quest_select(q, kmin, kmax, 10, 1)
    with pytest.raises(ValueError, match="shape mismatch"):
        quest_select(q[:, :32], kmin, kmax, 10, 4)
    with pytest.raises(ValueError, match="shape mismatch"):
        quest_select(q, kmin, kmax, 20, 4)  # more blocks than the bounds hold


def q8_cache(n_kv, hd, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = KVCache(1, n_kv, hd, length, MODES["q8"], options=CacheOptions(track_blocks=True))
    c.write(0, 0, torch.randn(n_kv, length, hd, generator=g), torch.randn(n_kv, length, hd, generator=g))
    return c


def test_engine_selects_compiled_on_cpu_like_the_torch_reference():
    c = q8_cache(2, 64, 1000)
    q = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    cfg = SparseConfig("quest", budget=256, dense_layers=0, min_ctx=0)
    got = select_blocks(q, c, 0, 1000, cfg)
    nb = -(-1000 // BLOCK)
    ref = top_blocks(quest_scores(q, c.bounds.kmin[0][:, :nb], c.bounds.kmax[0][:, :nb]), 8)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("backend", ["numba", "numba-int16"])
def test_sparse_attend_through_fused_kernels_matches_masked_reference(backend):
    """make_attend's sparse decode on a q8 cache: compiled selection, then the fused (float or
    integer-score) kernel over the selected blocks, against float64 attention over those blocks."""
    c = q8_cache(2, 64, 999, seed=1)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, 1, 64, generator=g) for n in (8, 2, 2))
    cfg = SparseConfig("quest", budget=200, dense_layers=0, min_ctx=0)
    out = make_attend(c, False, backend, None, cfg)(0, q, k, v, 999)[:, 0]
    blocks = select_blocks(q[:, 0], c, 0, 1000, cfg)
    assert blocks.shape == (2, 7)
    kd, vd = c.read(0, 1000)
    ref = reference_attention(
        q.double(), kd.double(), vd.double(), kv_mask=blocks_to_mask(blocks, 1000, BLOCK)
    )
    # score error δ: f32 rounding, 2·hd·u·Σ|q k|/8, plus (numba-int16) the query's rounding, half a
    # step (max|q|/32767) per value; the output moves by ≤ 2δ·max|v| (softmax), x2 headroom
    qa, ka = q[:, 0].double().abs(), kd.double().abs().amax(1).repeat_interleave(4, 0)
    delta = 2 * 64 * U32 * (qa * ka).sum(-1) / 8
    if backend == "numba-int16":
        delta += (qa.amax(-1) / 32767 / 2) * ka.sum(-1) / 8
    tol = 2 * (2 * delta * vd.abs().max() + 64 * U32 * vd.abs().max())
    err = (out.double() - ref[:, 0]).abs().amax(-1)
    assert (err <= tol).all(), (err / tol).max().item()
    dense = reference_attention(q.double(), kd.double(), vd.double())[:, 0]
    assert ((out.double() - dense).abs().amax(-1) > 2 * tol).all()  # dense is outside the tolerance


def test_sparse_bench_times_both_selections_through_each_backend():
    from kvlens.bench.sparse import run_sparse_bench

    rows = run_sparse_bench([1024], ["smollm2"], [256], ["quest"], reps=1, backends=["numba", "numba-int16"])
    assert [(r.backend, r.variant) for r in rows] == [
        (b, v) for b in ("numba", "numba-int16") for v in ("dense q8", "quest 256", "quest 256 torch sel")
    ]
    for r in rows:
        assert 0 < r.select_us < r.us_per_call if r.variant != "dense q8" else r.speedup_vs_dense == 1.0

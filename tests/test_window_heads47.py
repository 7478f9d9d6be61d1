"""A sliding-window layer whose KV heads are stored in different kinds (a per-head recipe): the fused
kernel runs once per KV head (engine.attention.split_kernel), and each call must keep the window. The
result is the float64 windowed attention over the rows the cache holds. No test ran a window through
the per-head split before: dropping it there passed everything (a mutation run, forty-seventh session)."""

from __future__ import annotations

import pytest
import torch
from test_int_attention import quantized_query

from kvlens.engine.attention import make_attend
from kvlens.kernels.reference import reference_attention
from kvlens.kv.cache import HeadSplitStore, KVCache
from kvlens.kv.modes import StoreKind
from kvlens.kv.recipe import head_recipe_mode

pytestmark = pytest.mark.usefixtures("one_thread")
F16, Q8, Q4 = (StoreKind(x) for x in ("f16", "q8", "q4"))  # none rotated: q is read in its own basis


@pytest.mark.parametrize("backend", ["numba", "numba-int", "numba-int16"])
@pytest.mark.parametrize(("window", "end"), [(4, 100), (40, 150), (37, 75), (200, 150)])
def test_a_windowed_per_head_layer_equals_the_full_windowed_attention(backend, window, end):
    gen = torch.Generator().manual_seed(window + end)
    n_kv, hd, group = 2, 64, 2
    heads = [[(Q8, Q4), (Q8, F16)]] if "int" in backend else [[(Q8, Q4), (F16, Q8)]]  # int8 K to score
    cache = KVCache(1, n_kv, hd, end, head_recipe_mode("r", heads))
    assert isinstance(cache.k[0], HeadSplitStore)
    k, v = (torch.randn(n_kv, end, hd, generator=gen) for _ in range(2))
    cache.write(0, 0, k[:, :-1], v[:, :-1])
    q = torch.randn(group * n_kv, 1, hd, generator=gen)
    out = make_attend(cache, False, backend, window)(0, q, k[:, -1:], v[:, -1:], end - 1)
    k_all, v_all = (x.double() for x in cache.read(0, end))
    if "int" in backend:  # the query as the integer kernel quantized it (test_int_attention's rule)
        codes, step = quantized_query(q[:, 0], 16 if backend.endswith("16") else 8)
        q_used = (codes * step)[:, None]
    else:
        q_used = q.double()
    ref = reference_attention(q_used, k_all, v_all, torch.tensor([end - 1]), window)
    full = reference_attention(q_used, k_all, v_all, torch.tensor([end - 1]), None)
    if window < end:  # the window matters here: the two references differ far beyond the tolerance
        assert (full - ref).abs().max() > 100 * 1e-5 * float(ref.abs().max())
    # f32 sums over at most 150 rows of 64 values: a few ulps (~1e-6) of the output's scale; 1e-5 as in
    # test_window_decode (the integer scores are exact sums, scaled once in f32)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))

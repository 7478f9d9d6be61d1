"""A windowed layer's decode step reads only the rows its window reaches (engine.attention): the
result is the float64 windowed attention over everything the cache holds (the same stored rows)."""

from __future__ import annotations

import pytest
import torch

from kvlens.engine.attention import make_attend
from kvlens.kernels.reference import reference_attention
from kvlens.kv.cache import KVCache
from kvlens.kv.modes import KVMode
from kvlens.kv.quant import rotate_rows, rotation

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("mode", ["f32", "f16", "bf16", "q8", "q4h", "k=q8,v=q4"])
@pytest.mark.parametrize("window,end", [(4, 100), (40, 41), (40, 150), (37, 75)])
def test_windowed_decode_equals_the_full_windowed_attention(mode, window, end, backend):
    gen = torch.Generator().manual_seed(window + end)
    n_kv, hd = 1, 256
    cache = KVCache(1, n_kv, hd, end, KVMode.parse(mode))
    k, v = (torch.randn(n_kv, end, hd, generator=gen) for _ in range(2))
    cache.write(0, 0, k[:, :-1], v[:, :-1])
    q = torch.randn(2 * n_kv, 1, hd, generator=gen)
    out = make_attend(cache, False, backend, window)(0, q, k[:, -1:], v[:, -1:], end - 1)
    # in the stored basis, over all `end` rows with the window mask (rotated kinds: q in K's basis)
    k_all, v_all = cache.read(0, end)
    k_span, v_span = cache.k[0].kind.rotation_span(hd), cache.v[0].kind.rotation_span(hd)
    qs = rotate_rows(q, k_span) if k_span else q
    ref = reference_attention(qs.double(), k_all.double(), v_all.double(), torch.tensor([end - 1]), window)
    if v_span:
        ref = ref @ rotation(hd, torch.float64, span=v_span).T
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))

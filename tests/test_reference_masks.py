"""The reference attention's masks taken together: a query sees a key only where the causal (and
window) mask *and* its KV head's sparse selection both allow it. Checked against an explicit float64
loop over each (head, query)'s allowed keys, for the float64 reference and torch's fused SDPA."""

from __future__ import annotations

import math

import pytest
import torch

from kvlens.kernels.reference import reference_attention, sdpa_attention


def _loop(q, k, v, q_pos, window, kv_mask):
    n_heads, n_q, d = q.shape
    group = n_heads // k.shape[0]
    out = torch.zeros(n_heads, n_q, d, dtype=torch.float64)
    for h in range(n_heads):
        for i in range(n_q):
            keys = [
                j
                for j in range(k.shape[1])
                if j <= q_pos[i] and (window is None or j > q_pos[i] - window) and kv_mask[h // group, j]
            ]
            kk, vv = k[h // group, keys].double(), v[h // group, keys].double()
            w = torch.softmax(kk @ q[h, i].double() / math.sqrt(d), dim=0)
            out[h, i] = w @ vv
    return out


@pytest.mark.parametrize("window", [None, 4])
def test_causal_window_and_selection_together(window):
    g = torch.Generator().manual_seed(7)
    n_heads, n_kv, n_k, d = 4, 2, 10, 16
    q, k, v = (
        torch.randn(n, s, d, generator=g, dtype=torch.float64)
        for n, s in ((n_heads, 3), (n_kv, n_k), (n_kv, n_k))
    )
    q_pos = torch.tensor([5, 7, 9])
    kv_mask = torch.zeros(n_kv, n_k, dtype=torch.bool)
    kv_mask[0, [0, 1, 4, 5, 8, 9]] = True  # every query keeps a key its causal/window mask allows
    kv_mask[1, [3, 4, 5, 6, 7]] = True
    want = _loop(q, k, v, q_pos, window, kv_mask)
    got = reference_attention(q, k, v, q_pos, window, kv_mask=kv_mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    fused = sdpa_attention(q.float(), k.float(), v.float(), q_pos, window, kv_mask)
    torch.testing.assert_close(fused.double(), want, rtol=0, atol=1e-5)  # f32 over |scores| of a few units

"""Integer scores over 4-bit K (q4, q4h: kernels.q4int, intdot.score4) against float64 references.

Every CPU path the host supports runs (the portable one everywhere). The reference decodes the 4-bit
store independently (numpy nibbles and fp16 scales: test_kv_rotated_q4.store_values) and quantizes
the query by the documented 8-bit rule (test_int_attention.quantized_query); two references as
there: the quantized query (only f32 rounding differs) and the exact one (the query's step).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import literally, njit
from test_int_attention import EPS32, PATH_PARAMS, quantized_query
from test_kv_rotated_q4 import case, store_values

from kvlens.engine.attention import BackendError, make_attend
from kvlens.kernels import intdot, q4int
from kvlens.kernels.cpu_int import IntAttn, decode_attention_int
from kvlens.kernels.reference import reference_attention
from kvlens.kv.cache import KVCache, RowStore
from kvlens.kv.modes import KVMode, StoreKind

pytestmark = pytest.mark.usefixtures("one_thread")


def check(path, kinds, n_heads, n_kv, hd, length, seed=0, n_splits=None, blocks=None, table=None):
    q, ks, vs = case(*kinds, n_heads, n_kv, hd, length, seed=seed)
    out = decode_attention_int(q, ks, vs, length, n_splits, blocks, IntAttn(8, path), table).double()
    kf, vf = store_values(ks, length), store_values(vs, length)
    mask = None
    if blocks is not None:
        mask = (torch.arange(length)[None, None] // 32 == torch.as_tensor(blocks).long()[:, :, None]).any(1)
    codes, step = quantized_query(q, 8)
    qq = codes * step
    ref_q = reference_attention(qq[:, None], kf, vf, kv_mask=mask)[:, 0]
    # f32 rounding of a score: per lane an exact integer (the +8 taken off in integers) times two
    # rounded f32 products, then hd/8 lane terms summed, each bounded by sum |q_d k_d| over its values
    kg = kf.repeat_interleave(n_heads // n_kv, 0)
    mag = torch.einsum("hd,hld->hl", qq.abs(), kg.abs()) / math.sqrt(hd)
    bound = (hd / 8 + 3) * EPS32 * float(mag.max()) * 2  # x2 headroom
    vmax = float(vf.abs().max())
    tol = 1e-5 * float(ref_q.abs().max()) + 2.5 * bound * vmax
    torch.testing.assert_close(out, ref_q, rtol=0, atol=tol)
    # against the exact query: a score moves by at most sum_d (step_d / 2) |k_d| / sqrt(hd)
    ref = reference_attention(q.double()[:, None], kf, vf, kv_mask=mask)[:, 0]
    ds = float(torch.einsum("hd,hld->hl", step / 2, kg.abs()).max()) / math.sqrt(hd) + bound
    torch.testing.assert_close(out, ref, rtol=0, atol=(math.exp(2 * ds) - 1) * vmax + tol)


KINDS = [("q4", "q4"), ("q4h", "f16"), ("q4", "q8"), ("q4h", "q4h")]
# (n_heads, n_kv, hd, length): GQA 1/3/4, head_dim 64/128/256, one row, a partial tile, many tiles
SHAPES = [(4, 4, 64, 1), (9, 3, 64, 700), (8, 2, 128, 33), (4, 1, 256, 700)]


@pytest.mark.parametrize("path", PATH_PARAMS)
@pytest.mark.parametrize("n_heads,n_kv,hd,length", SHAPES)
@pytest.mark.parametrize("kinds", KINDS)
def test_q4_scores_match_reference(path, kinds, n_heads, n_kv, hd, length):
    check(path, kinds, n_heads, n_kv, hd, length, seed=hd + length)


@pytest.mark.parametrize("path", PATH_PARAMS)
def test_q4_splits_sparse_blocks_and_block_table(path):
    for n_splits in (1, 3, 40):  # split edges inside and at tiles, more splits than tiles
        check(path, ("q4h", "q4"), 8, 2, 128, 1000, seed=n_splits, n_splits=n_splits)
    check(path, ("q4", "q4"), 6, 2, 64, 300, seed=4, blocks=np.array([[0, 3, 9], [1, 2, 5]], np.int32))
    # through a block table: the physical blocks hold the logical ones in reverse (all in range)
    q, ks, vs = case("q4", "q4h", 6, 2, 64, 128, seed=5)
    table = np.array([3, 2, 1, 0], np.int32)
    out = decode_attention_int(q, ks, vs, 128, spec=IntAttn(8, path), table=table)
    rows = torch.from_numpy(table).repeat_interleave(32) * 32 + torch.arange(32).repeat(4)
    lk, lv = (RowStore(s.kind, s.data[:, rows].clone(), s.scale[:, rows].clone()) for s in (ks, vs))
    torch.testing.assert_close(
        out, decode_attention_int(q, lk, lv, 128, spec=IntAttn(8, path)), rtol=0, atol=0
    )


@njit
def _score(path, qp, qoff, qs, k, bs, out):  # pragma: no cover - compiled
    intdot.score4(literally(path), qp.ctypes.data, qoff.ctypes.data, qs.ctypes.data, k.ctypes.data,
                  bs.ctypes.data, k.shape[1], k.shape[0], out.ctypes.data)  # fmt: skip


@pytest.mark.parametrize("path", PATH_PARAMS)
@settings(max_examples=30, deadline=None)
@given(data=st.data(), hd=st.sampled_from([64, 128, 256]))
def test_score4_integer_sums_are_exact(path, data, hd):
    """Unit scales: each row's score is exactly sum q * (u - 8) (f32 holds it: |.| < 2^24), the stored
    codes u packed here by the documented layout (byte i of a block: u_i low, u_(i+16) high)."""
    q = np.array(data.draw(st.lists(st.sampled_from([-127, -1, 0, 1, 127]) | st.integers(-127, 127),
                                    min_size=hd, max_size=hd)), np.int8)[None]  # fmt: skip
    u = np.array(data.draw(st.lists(st.integers(0, 15), min_size=3 * hd, max_size=3 * hd)), np.int64)
    u = u.reshape(3, hd)
    blocks = u.reshape(3, hd // 32, 2, 16)
    k = (blocks[:, :, 0] | blocks[:, :, 1] << 4).astype(np.uint8).reshape(3, hd // 2)
    qp = q4int.permute_query(q)
    ones = np.ones(hd // 8, np.float32)
    out = np.empty(3, np.float32)
    _score(
        intdot.PATHS.index(path),
        qp[0],
        q4int.lane_offsets(qp)[0],
        ones,
        k,
        np.ones(3 * hd // 32, np.float32),
        out,
    )
    assert out.tolist() == ((u - 8) @ q[0].astype(np.int64)).tolist()


def test_4bit_k_refusals():
    q = torch.zeros(2, 64)
    k4, v = (RowStore.empty(kind, 1, 32, 64, torch.device("cpu")) for kind in (StoreKind.Q4, StoreKind.F16))
    for spec in (IntAttn(16), IntAttn(8, pv8=True)):
        with pytest.raises(ValueError, match="or 4-bit with an 8-bit query, got q4"):
            decode_attention_int(q, k4, v, 1, spec=spec)
    k32 = RowStore.empty(StoreKind.Q4, 1, 32, 32, torch.device("cpu"))
    with pytest.raises(ValueError, match="head_dim divisible by 64"):
        decode_attention_int(torch.zeros(2, 32), k32, k32, 1, spec=IntAttn(8))
    with pytest.raises(BackendError, match=r"int8 K cache \(q8, q8h, q8-k, q8\+mirror\), not q4h"):
        make_attend(KVCache(1, 1, 64, 8, KVMode.parse("q4h")), prefill=False, backend="numba-int16")
    with pytest.raises(BackendError, match="or 4-bit with numba-int"):
        make_attend(KVCache(1, 1, 64, 8, KVMode.parse("f16")), prefill=False, backend="numba-int")
    make_attend(KVCache(1, 1, 64, 8, KVMode.parse("q4h")), prefill=False, backend="numba-int")  # accepted

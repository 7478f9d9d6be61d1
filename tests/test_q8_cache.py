"""The seed's int8 rule, bit for bit, and the cache that stores it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvlens.kv import (
    MODES,
    CacheOptions,
    KVCache,
    KVMode,
    NonFiniteError,
    NonFiniteKVError,
    UnknownKVModeError,
    dequantize_q8,
    quantize_q8,
)
from kvlens.kv.quant import first_nonfinite, store_q8


def rule(row: list[float]) -> tuple[list[int], float]:
    """The seed's rule written out scalar by scalar in float32 (numpy), as the C engine does it."""
    x = np.asarray(row, dtype=np.float32)
    m = np.float32(np.max(np.abs(x)))
    if m < np.float32(1e-6):
        m = np.float32(1.0)
    inv = np.float32(127.0) / m
    q = [int(max(-127, min(127, math.floor(np.float32(v * inv) + np.float32(0.5))))) for v in x]
    return q, float(m)


def check(row: list[float]) -> None:
    q, m = quantize_q8(torch.tensor([row], dtype=torch.float32))
    want_q, want_m = rule(row)
    assert q.dtype == torch.int8
    assert q[0].tolist() == want_q
    assert m.dtype == torch.float32 and m[0].item() == want_m


def test_hand_written_rows():
    check([0.0] * 8)  # zeros: max_abs < 1e-6 → 1.0, all codes 0
    check([1e-7, -5e-7, 0.0, 2e-7])  # tiny row: uses max_abs 1.0 → codes 0
    check([127.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.0])  # exact .5 ties: half up (−0.5 → 0, −1.5 → −1)
    check([1000.0] + [0.01] * 7)  # a single outlier crushes the rest to 0
    check([-3.0, 1.0, 2.0, -1.0])  # max at −: −3 → −127
    check([3.0, -1.0, 0.25, 1.0])  # max at +


def test_exact_ties_round_half_up():
    q, m = quantize_q8(torch.tensor([[127.0, 0.5, -0.5, 1.5, -1.5, 126.5, -126.5]]))
    assert m.item() == 127.0
    assert q[0].tolist() == [127, 1, 0, 2, -1, 127, -126]


def test_random_rows_bit_exact():
    g = torch.Generator().manual_seed(0)
    for scale in (1e-3, 1.0, 37.0):
        x = torch.randn(64, 64, generator=g) * scale
        q, m = quantize_q8(x)
        for i in range(0, 64, 7):
            want_q, want_m = rule(x[i].tolist())
            assert q[i].tolist() == want_q and m[i].item() == want_m


def test_near_tie_rows_both_paths_equal_the_float32_rule():
    """Rows whose values sit at (and one ulp either side of) every half-code boundary, so one ulp in
    127/max_abs (a reciprocal-then-multiply instead of the division) flips codes; random rows almost never do."""
    rng = np.random.default_rng(0)
    m = (rng.random(1024) * 4 + 0.1).astype(np.float32)
    ties = (m[:, None] * (np.arange(-126, 126, dtype=np.float32) + np.float32(0.5)) / np.float32(127)).astype(
        np.float32
    )
    up, down = np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf))
    x = np.concatenate([m[:, None], ties, up, down], axis=1).astype(np.float32)
    inv = (np.float32(127.0) / m).astype(np.float32)  # IEEE float32 division, correctly rounded
    want = np.clip(np.floor(x * inv[:, None] + np.float32(0.5)), -127, 127).astype(np.int8)
    q, got_m = quantize_q8(torch.from_numpy(x))
    assert np.array_equal(q.numpy(), want) and np.array_equal(got_m.numpy(), m)
    data, scale = torch.zeros(1, 1024, x.shape[1], dtype=torch.int8), torch.zeros(1, 1024)
    store_q8(torch.from_numpy(x)[None], data, scale, 0)
    assert np.array_equal(data[0].numpy(), want) and np.array_equal(scale[0].numpy(), m)


def test_dequantize_is_code_times_step():
    q = torch.tensor([[127, -127, 3, 0]], dtype=torch.int8)
    out = dequantize_q8(q, torch.tensor([2.54]))
    step = np.float32(2.54) / np.float32(127)
    assert out[0].tolist() == [float(np.float32(c) * step) for c in (127, -127, 3, 0)]


def test_any_leading_shape():
    x = torch.randn(2, 3, 5, 16)
    q, m = quantize_q8(x)
    assert q.shape == x.shape and m.shape == (2, 3, 5)
    assert dequantize_q8(q, m).shape == x.shape


# float32 rounding past half a step, in steps: 127/m, x·inv and the +0.5 (≤ 254u + 2^-18 at codes up to
# 127.5) before the floor; m/127 (as a product with 1/127) and q·step (≤ 3u relative, 381u at 127 steps).
_Q8_ROUNDING_STEPS = 635 * 2.0**-24 + 2.0**-18


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.integers(1, 96), elements=st.floats(-1e4, 1e4, width=32)))
# a row 7.1e-6 steps past half a step (a bound of half a step × (1 + 1e-5) missed it)
@example(np.array([9999.0, 7912.59423828125], dtype=np.float32))
def test_error_at_most_half_a_step(row):
    """Half a step plus what float32 allows; a row under TINY_MAX_ABS (1e-6) is stored as zeros."""
    x = torch.from_numpy(row)[None]
    q, m = quantize_q8(x)
    err = (dequantize_q8(q, m) - x).abs().max().item()
    assert err <= m.item() / 127 * (0.5 + _Q8_ROUNDING_STEPS) + 1e-6


_ROW_VALUES = st.one_of(
    st.floats(-1e4, 1e4, width=32),
    st.sampled_from([0.0, 0.5, -0.5, 1.5, -1.5, 126.5, -126.5, 127.0, 1e-7, -3e-7]),  # ties, tiny rows
)


@settings(max_examples=80, deadline=None)
@given(
    arrays(
        np.float32, st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 80)), elements=_ROW_VALUES
    )
)
def test_jit_store_is_bit_identical_to_quantize_q8(x):
    """The engine's per-token write path (one JIT pass) stores exactly quantize_q8's codes and max_abs."""
    rows = torch.from_numpy(x)
    n_kv, n, d = rows.shape
    data = torch.zeros(n_kv, n + 7, d, dtype=torch.int8)
    scale = torch.zeros(n_kv, n + 7)
    store_q8(rows.transpose(0, 1).contiguous().transpose(0, 1), data, scale, 3)  # non-contiguous input
    q, m = quantize_q8(rows)
    assert torch.equal(data[:, 3 : 3 + n], q) and torch.equal(scale[:, 3 : 3 + n], m)
    assert not data[:, :3].any() and not data[:, 3 + n :].any()


def test_first_nonfinite_flat_index():
    x = torch.zeros(2, 3, 4)
    assert first_nonfinite(x) is None
    x[1, 2, 1] = float("-inf")
    x[1, 2, 3] = float("nan")
    assert first_nonfinite(x) == 1 * 12 + 2 * 4 + 1
    assert first_nonfinite(x.to(torch.float16)) == 1 * 12 + 2 * 4 + 1  # the torch path agrees


def test_non_finite_raises():
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(NonFiniteError):
            quantize_q8(torch.tensor([[1.0, bad]]))


def test_cache_refuses_non_finite_naming_layer_and_position():
    cache = KVCache(n_layers=4, n_kv_heads=2, head_dim=8, capacity=64, mode=MODES["q8"])
    k = torch.randn(2, 5, 8)
    v = torch.randn(2, 5, 8)
    v[1, 3, 2] = float("nan")
    with pytest.raises(NonFiniteKVError, match="non-finite V value at layer 2, position 13"):
        cache.write(2, 10, k, v)


def test_cache_modes_store_what_they_say():
    k, v = torch.randn(3, 40, 16), torch.randn(3, 40, 16)
    for mode, k_exact, v_exact in (
        ("f32", True, True),
        ("q8", False, False),
        ("q8-k", False, True),
        ("q8-v", True, False),
    ):
        c = KVCache(1, 3, 16, 8, MODES[mode])  # capacity 8 → grows block by block to 64
        c.write(0, 0, k, v)
        assert c.capacity == 64 and c.length == 40
        rk, rv = c.read(0, 40)
        assert torch.equal(rk, k) == k_exact and torch.equal(rv, v) == v_exact
        qk, mk = quantize_q8(k)
        if not k_exact:
            assert torch.equal(rk, dequantize_q8(qk, mk))


@pytest.mark.parametrize("sink,recent", [(4, 10), (1, 1), (0, 3), (5, 0), (30, 30)])
@pytest.mark.parametrize("end", [1, 6, 37, 50])
def test_keep_sink_and_recent_exact_boundaries(sink, recent, end):
    """Exactly positions [0, sink) read as their f16 rounding (the sink store) and [end - recent, end)
    as they are (the exact copy, read last); every other row is its int8 row."""
    g = torch.Generator().manual_seed(sink * 1000 + recent * 100 + end)
    k, v = torch.randn(2, 50, 8, generator=g), torch.randn(2, 50, 8, generator=g)
    c = KVCache(2, 2, 8, 64, MODES["q8"], options=CacheOptions(keep_sink=sink, keep_recent=recent))
    for layer in range(2):
        c.write(layer, 0, k, v)
    kq, vq = (dequantize_q8(*quantize_q8(x)) for x in (k, v))
    assert ((kq != k).any(-1) & (vq != v).any(-1)).all()  # no random row survives int8 unchanged
    kh, vh = k.half().float(), v.half().float()
    assert ((kh != k).any(-1) & (kh != kq).any(-1)).all()  # and none as f16, or f16 as int8
    for layer in range(2):
        rk, rv = c.read(layer, end)
        for pos in range(end):
            want_k, want_v = (kq, vq) if pos >= sink else (kh, vh)
            want_k, want_v = (k, v) if pos >= end - recent else (want_k, want_v)
            assert torch.equal(rk[:, pos], want_k[:, pos]) and torch.equal(rv[:, pos], want_v[:, pos]), pos


def test_unknown_mode():
    with pytest.raises(UnknownKVModeError, match="q7"):
        KVMode.parse("q7")
    with pytest.raises(TypeError, match="KVMode"):
        KVCache(1, 1, 8, 8, "q8")  # names are parsed at the edge, not inside

"""Property tests for every KV quantization scheme in kvlens.kv.schemes (and known-value checks)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvlens.kv.quant import NonFiniteError, dequantize_q8, quantize_q8
from kvlens.kv.schemes import SCHEMES, _from_groups, _to_groups, get_scheme
from kvlens.models.blockquant import roundf

NAMES = list(SCHEMES)
EPS = float(torch.finfo(torch.float32).eps)
FAST = settings(max_examples=25, deadline=None)


def kv_tensors(min_abs: float = 0.0, max_abs: float = 1e4):
    """[n_kv, L, d] float32 tensors; entries below ``min_abs`` in magnitude are set to 0."""

    @st.composite
    def build(draw):
        shape = (draw(st.integers(1, 2)), draw(st.integers(1, 40)), draw(st.integers(1, 72)))
        elems = st.floats(-max_abs, max_abs, width=32, allow_subnormal=False)
        a = draw(arrays(np.float32, shape, elements=elems))
        a[np.abs(a) < min_abs] = 0.0
        return torch.from_numpy(a)

    return build()


def error_bound(name: str, x: torch.Tensor, role: str) -> torch.Tensor:
    """step/2 (q4, llama.cpp's q4_0: up to a step where the side opposite the block's max clips at +7,
    max(step/2, |x| - 7 step)), plus llama.cpp's fp16-scale term qmax·|d - fp16(d)|, plus float
    rounding."""
    s = get_scheme(name)
    step = s.step(x, role)
    bound = (
        torch.maximum(step / 2, x.abs() - 7 * step) if name == "q4" else step / 2
    ) + 8 * EPS * x.abs().amax()
    if s.fp16_scale:
        axis = s.axis(role)
        d = _to_groups(x, axis, s.group).abs().amax(-1, keepdim=True) / s.qmax
        extra = (s.qmax * (d - d.half().float()).abs()).expand(*d.shape[:-1], s.group)
        bound = bound + _from_groups(extra, x.shape, axis)
    return bound


@pytest.mark.parametrize("name", NAMES)
@FAST
@given(x=kv_tensors())
def test_error_at_most_half_a_step(name, x):
    for role in ("k", "v"):
        err = (SCHEMES[name].fake_quant(x, role) - x).abs()
        assert bool((err <= error_bound(name, x, role)).all())


@pytest.mark.parametrize("name", NAMES)
@FAST
@given(x=kv_tensors(min_abs=0.1), k=st.integers(-3, 3))
def test_power_of_two_scaling_is_exact(name, x, k):
    # |x| >= 0.1 keeps every scale normal (fp16 ones too), so scaling by 2^k is exact end to end
    x2 = x * 2.0**k
    assume(bool((x2 / 2.0**k == x).all()))
    s = SCHEMES[name]
    for role in ("k", "v"):
        a, b = s.quantize(x, role), s.quantize(x2, role)
        assert torch.equal(a.codes.float(), b.codes.float())
        assert torch.equal(s.dequantize(b), s.dequantize(a) * 2.0**k)


@pytest.mark.parametrize("name", NAMES)
@FAST
@given(x=kv_tensors())
def test_idempotent_codes(name, x):
    s = SCHEMES[name]
    for role in ("k", "v"):
        qt = s.quantize(x, role)
        again = s.quantize(s.dequantize(qt), role)
        assert torch.equal(again.codes.float(), qt.codes.float())


@pytest.mark.parametrize("name", NAMES)
@FAST
@given(
    c=st.floats(-1e4, 1e4, width=32, allow_subnormal=False),
    shape=st.tuples(st.integers(1, 2), st.integers(1, 40), st.integers(1, 70)),
)
def test_zero_and_constant_rows(name, c, shape):
    s = SCHEMES[name]
    zero = torch.zeros(shape)
    x = torch.full(shape, c)
    for role in ("k", "v"):
        assert torch.equal(s.fake_quant(zero, role), zero)
        y = s.fake_quant(x, role)
        assert bool((y == y.flatten()[0]).all()), "a constant tensor must stay constant"
        assert bool(((y - x).abs() <= error_bound(name, x, role)).all())
        # fp32 scales reproduce a constant to float rounding (below 1e-6 the seed's q8 rule uses
        # max_abs = 1.0 and returns 0, within its half step of 1/254)
        if not s.fp16_scale and abs(c) >= 1e-6:
            assert abs(float(y.flatten()[0]) - c) <= 4 * EPS * abs(c)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_raises(name, bad):
    x = torch.randn(2, 40, 64)
    x[1, 33, 7] = bad
    for role in ("k", "v"):
        with pytest.raises(NonFiniteError):
            SCHEMES[name].fake_quant(x, role)
        with pytest.raises(NonFiniteError):
            SCHEMES[name].step(x, role)


def test_q8_is_the_seed_rule():
    x = torch.randn(3, 50, 128, generator=torch.Generator().manual_seed(1)) * 3
    qt = SCHEMES["q8"].quantize(x)
    q, m = quantize_q8(x)
    assert torch.equal(qt.codes.reshape(q.shape), q)
    assert torch.equal(SCHEMES["q8"].fake_quant(x), dequantize_q8(q, m))
    assert torch.equal(SCHEMES["q8"].step(x), (m / 127).unsqueeze(-1).expand_as(x))


def test_roundf_is_half_away_from_zero():
    y = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, -0.49999997, 3.0])
    assert roundf(y).tolist() == [1.0, 2.0, 3.0, -1.0, -3.0, 0.0, 0.0, 3.0]


def test_q8_0_matches_llama_cpp_arithmetic():
    # block absmax 127 -> d = 1, codes = roundf(x): 2.5 -> 3 (half-to-even would give 2); d stored as fp16
    x = torch.zeros(1, 1, 32)
    x[0, 0, :4] = torch.tensor([127.0, 2.5, -2.5, 0.4])
    qt = SCHEMES["q8_0"].quantize(x)
    assert qt.codes.flatten()[:4].tolist() == [127, 3, -3, 0]
    assert qt.scale.dtype == torch.float16 and float(qt.scale.flatten()[0]) == 1.0
    y = torch.full((1, 1, 32), 1.0 / 3)  # d = (1/3)/127 is not an fp16 value: dequantized with fp16(d)
    d16 = float(torch.tensor((1.0 / 3) / 127).half())
    assert torch.allclose(SCHEMES["q8_0"].fake_quant(y), torch.full_like(y, 127 * d16), rtol=0, atol=0)


def test_q4_is_llama_cpp_q4_0_by_hand():
    # max +8 (first of the |8| tie) -> d = -1: 8 -> code -8; -8 -> 16.5 clips to +7 (value -7: a whole
    # step off); 0.5 -> 8.0 -> 0; -0.5 -> 9.0 -> +1 (value -1); 3.25 -> 5.25 -> 5 - 8 = -3 (value 3)
    x = torch.zeros(1, 1, 32)
    x[0, 0, :5] = torch.tensor([8.0, -8.0, 0.5, -0.5, 3.25])
    qt = SCHEMES["q4"].quantize(x)
    assert qt.codes.flatten()[:5].tolist() == [-8, 7, 0, 1, -3]
    assert qt.scale.dtype == torch.float16 and float(qt.scale.flatten()[0]) == -1.0
    assert SCHEMES["q4"].fake_quant(x).flatten()[:5].tolist() == [8.0, -7.0, 0.0, -1.0, 3.0]
    assert float(SCHEMES["q4"].step(x).min()) == 1.0  # the step is |d|


def test_block_schemes_use_blocks_of_32_along_head_dim():
    x = torch.ones(1, 2, 64)
    x[0, 0, 40] = 100.0  # only the second block of row 0 gets the big scale
    st_ = SCHEMES["q8_0"].step(x)
    assert float(st_[0, 0, :32].max()) < 0.01 and float(st_[0, 0, 32:].min()) > 0.7
    assert float(st_[0, 1].max()) < 0.01


def test_kivi_keys_per_channel_values_per_token():
    x = torch.randn(1, 64, 32, generator=torch.Generator().manual_seed(0))
    x[..., 5] *= 100.0  # an outlier channel
    kivi = SCHEMES["kivi4"]
    sk, sv = kivi.step(x, "k"), kivi.step(x, "v")
    # keys: one step per (channel, 32-token group); the outlier channel's step does not leak
    assert torch.equal(sk[0, :32, 0], sk[0, :1, 0].expand(32))
    assert float(sk[0, :, 5].min()) > 10 * float(sk[0, :, 4].max())
    # values: one step per (token, 32 channels): the outlier inflates every channel of the token
    assert torch.equal(sv[0, 0], sv[0, 0, :1].expand(32))
    k_err = (kivi.fake_quant(x, "k") - x)[..., 4].abs().max()
    q8_err = (SCHEMES["q8"].fake_quant(x, "k") - x)[..., 4].abs().max()
    assert float(k_err) < float(q8_err)


def test_fp8_values_are_e4m3_grid_points():
    x = torch.randn(2, 17, 64, generator=torch.Generator().manual_seed(2))
    s = SCHEMES["fp8"]
    qt = s.quantize(x)
    y = qt.codes.float()
    assert torch.equal(y, y.to(torch.float8_e4m3fn).float()) and float(y.abs().max()) == 448.0
    ratio = (s.fake_quant(x) - x).abs() / s.step(x)
    assert float(ratio.max()) <= 0.5 + 1e-6


def test_bits_per_value_and_registry():
    def bits(name: str, role: str, n_tokens: int, head_dim: int) -> float:
        s = SCHEMES[name]
        return s.bits_per_value(s.quantize(torch.randn(2, n_tokens, head_dim), role))

    nominal = {n: bits(n, "v", 64, 128) for n in NAMES}
    assert nominal == {"q8": 8.25, "q8_0": 8.5, "q4": 4.5, "fp8": 8.25, "kivi": 4.0, "kivi4": 6.0}
    assert bits("q8", "k", 3, 64) == 8.5 and bits("kivi", "k", 64, 12) == 4.0
    # a group cut short keeps its own scale: head_dim 12 is one 12-value block, 40 is 32 + 8
    assert math.isclose(bits("q4", "k", 5, 12), 4 + 16 / 12) and math.isclose(
        bits("q8_0", "v", 5, 40), 8 + 32 / 40
    )
    assert math.isclose(bits("kivi", "v", 5, 12), 2 + 64 / 12)
    assert math.isclose(bits("kivi", "k", 40, 64), 2 + 64 * 2 / 40)  # keys: groups of 32 tokens, 40 = 32 + 8
    with pytest.raises(ValueError, match="unknown scheme"):
        get_scheme("q3")
    with pytest.raises(ValueError, match="role"):
        SCHEMES["q8"].fake_quant(torch.ones(1, 2, 4), "q")
    assert math.isclose(SCHEMES["q4"].qmax, 8.0)

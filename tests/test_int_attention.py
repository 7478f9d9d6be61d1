"""Integer-score attention (kernels.cpu_int / kernels.intdot) against float64 references.

Every CPU path the host supports runs (the others skip, saying which features they lack); the
portable path runs everywhere. Two references per case:

* float64 attention over the dequantized cache with the query *as the kernel quantized it* (the
  rule written out here, independently): only f32 rounding differs, bounded from the integer sums;
* the same with the exact query: the difference is bounded by the query's quantization step.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import literally, njit

from kvlens.engine.attention import BackendError, make_attend, resolve_backend
from kvlens.kernels import cpu_int, intdot
from kvlens.kernels.cpu_int import IntAttn, decode_attention_int
from kvlens.kernels.reference import reference_attention
from kvlens.kv.cache import KVCache, RowStore
from kvlens.kv.modes import KVMode, StoreKind
from kvlens.kv.quant import dequantize_q8, quantize_q8

CPU = torch.device("cpu")
Q8 = StoreKind.Q8
HOST = intdot.host_features()
PATH_PARAMS = [
    pytest.param(
        p,
        marks=pytest.mark.skipif(
            not intdot.path_supported(p, HOST),
            reason=f"numba compiles for CPU features without {p} here (CPU or NUMBA_CPU_* pin)",
        ),
    )
    for p in intdot.PATHS
]
EPS32 = 2.0**-24


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny problems run on one thread


def make_stores(n_kv, hd, length, seed, zero_rows=()):
    gen = torch.Generator().manual_seed(seed)
    cap = length + 40
    ks = RowStore.empty(Q8, n_kv, cap, hd, CPU, with_ksum=True)
    vs = RowStore.empty(Q8, n_kv, cap, hd, CPU)
    for s in (ks, vs):
        rows = torch.randn(n_kv, length, hd, generator=gen) * torch.rand(n_kv, length, 1, generator=gen) * 4
        rows[:, list(zero_rows)] = 0.0
        s.write(0, rows)
        s.data[:, length:] = 127  # garbage past the end: reading it would show
        s.scale[:, length:] = 1e6
    return ks, vs


def quantized_query(q: torch.Tensor, qbits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, per-value step) of the query by the documented rules (8: per 32-block, 16: per row)."""
    n_heads, hd = q.shape
    if qbits == 8:
        codes, m = quantize_q8(q.view(n_heads, hd // 32, 32))
        return codes.view(n_heads, hd).double(), (m / 127.0).double().repeat_interleave(32, dim=1)
    m = q.abs().amax(dim=1, keepdim=True)
    m = torch.where(m < 1e-30, torch.ones_like(m), m)
    codes = torch.floor(q * (32767.0 / m) + 0.5).clamp(-32767, 32767)
    return codes.double(), (m / 32767.0).double().expand(n_heads, hd)


def check_case(path, qbits, n_heads, n_kv, hd, length, seed=0, n_splits=None, zero_rows=(), q_zero=False):
    ks, vs = make_stores(n_kv, hd, length, seed, zero_rows)
    q = torch.randn(n_heads, hd, generator=torch.Generator().manual_seed(seed + 1)) * 2
    if q_zero:
        q[:] = 0.0
    out = decode_attention_int(q, ks, vs, length, n_splits=n_splits, spec=IntAttn(qbits, path)).double()
    group = n_heads // n_kv
    k8 = ks.data[:, :length].double().repeat_interleave(group, 0)  # [H, L, hd] codes
    kf = dequantize_q8(ks.data[:, :length], ks.scale[:, :length]).double()
    vf = dequantize_q8(vs.data[:, :length], vs.scale[:, :length]).double()
    k_step = (ks.scale[:, :length].double() / 127.0).repeat_interleave(group, 0)  # [H, L]
    vmax = float(vf.abs().max())
    codes, step = quantized_query(q, qbits)
    ref_q = reference_attention((codes * step)[:, None], kf, vf)[:, 0]
    # f32 rounding of the score: the kernel sums (|q|+128)|k| terms at most (the +128 form), x4 headroom
    mag = torch.einsum("hd,hld->hl", (codes.abs() + 128) * step, k8.abs()) * k_step / math.sqrt(hd)
    bound = 4 * EPS32 * float(mag.max()) * 4
    tol = 1e-5 * float(ref_q.abs().max()) + 2.5 * bound * vmax
    torch.testing.assert_close(out, ref_q, rtol=0, atol=tol)
    # against the exact query: score error <= sum_d (step_d / 2) |k_d| / sqrt(hd)
    ref = reference_attention(q.double()[:, None], kf, vf)[:, 0]
    ds = float((torch.einsum("hd,hld->hl", step / 2, k8.abs()) * k_step).max()) / math.sqrt(hd) + bound
    torch.testing.assert_close(out, ref, rtol=0, atol=(math.exp(2 * ds) - 1) * vmax + tol)


# (n_heads, n_kv, hd, length): GQA 1/3/4/8, head_dim 64/128/256, lengths 1, 31, 32, 33, 1000
SHAPES = [
    (4, 4, 64, 1), (9, 3, 64, 31), (8, 2, 128, 32), (16, 2, 128, 33), (4, 4, 256, 1000),
    (9, 3, 128, 1000), (16, 2, 64, 1000), (8, 2, 256, 33),
]  # fmt: skip


@pytest.mark.parametrize("qbits", [8, 16])
@pytest.mark.parametrize("path", PATH_PARAMS)
@pytest.mark.parametrize("n_heads,n_kv,hd,length", SHAPES)
def test_paths_match_reference(path, qbits, n_heads, n_kv, hd, length):
    check_case(path, qbits, n_heads, n_kv, hd, length, seed=length + hd)


@pytest.mark.parametrize("qbits", [8, 16])
@pytest.mark.parametrize("path", PATH_PARAMS)
def test_splits_zero_rows_zero_query(path, qbits):
    for n_splits in (1, 3, 7, 40):  # split boundaries inside and at tile edges, more splits than tiles
        check_case(path, qbits, 8, 2, 128, 1000, seed=n_splits, n_splits=n_splits)
    check_case(path, qbits, 9, 3, 64, 100, zero_rows=(0, 31, 32, 33, 99))
    check_case(path, qbits, 4, 2, 64, 65, q_zero=True)


@pytest.mark.parametrize("path", PATH_PARAMS)
def test_sparse_blocks(path):
    """Sparse decode's block list: attention over the selected 32-position blocks only."""
    ks, vs = make_stores(2, 64, 300, seed=3)
    q = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    blocks = torch.tensor([[0, 3, 9], [1, 2, 5]], dtype=torch.int32)
    out = decode_attention_int(q, ks, vs, 300, blocks=blocks, spec=IntAttn(16, path)).double()
    kf = dequantize_q8(ks.data[:, :300], ks.scale[:, :300]).double()
    vf = dequantize_q8(vs.data[:, :300], vs.scale[:, :300]).double()
    mask = (torch.arange(300)[None, None] // 32 == blocks.long()[:, :, None]).any(1)
    ref = reference_attention(q.double()[:, None], kf, vf, kv_mask=mask)[:, 0]
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-3 * float(vf.abs().max()))


@njit
def _shifted_dot(path, qu, q8, k, ls):  # pragma: no cover - compiled
    return intdot.dot8(literally(path), qu.ctypes.data, q8.ctypes.data, k.ctypes.data, ls.ctypes.data, k.size)


def _int_dot(path_code, q, k):
    ls = np.ones(q.size // 4, np.float32)  # f32 holds these integers exactly (|sum| < 2^24)
    qu = (
        (q.astype(np.int16) + intdot.SHIFT).astype(np.uint8) if path_code <= 1 else np.abs(q).astype(np.uint8)
    )
    return _shifted_dot(path_code, qu, q, k, ls)


@pytest.mark.parametrize("path", PATH_PARAMS)
@settings(max_examples=40, deadline=None)
@given(data=st.data(), hd=st.sampled_from([64, 128, 256]))
def test_shift_correction_is_exact_in_integers(path, data, hd):
    """sum (q+128) k - 128 sum k == sum q k exactly, through the path's instructions, with the block
    sums the cache stores at write time; extreme codes (+-127, 0) included."""
    codes = st.lists(
        st.sampled_from([-127, -126, -1, 0, 1, 126, 127]) | st.integers(-127, 127), min_size=hd, max_size=hd
    )
    q = np.array(data.draw(codes), np.int8)
    k_rows = torch.tensor([data.draw(codes)], dtype=torch.float32)[None]  # [1, 1, hd]
    store = RowStore.empty(Q8, 1, 32, hd, CPU, with_ksum=True)
    store.write(0, k_rows)
    k = store.data[0, 0].numpy()
    exact = int(q.astype(np.int64) @ k.astype(np.int64))
    code = intdot.PATHS.index(path)
    got = _int_dot(code, q, k)
    if code <= 1:  # vnni: the shifted form, corrected by the stored block sums
        assert int(store.ksum[0, 0].sum()) == int(k.astype(np.int64).sum())
        got -= intdot.SHIFT * int(store.ksum[0, 0].to(torch.int64).sum())
    assert got == exact


def test_ksum_written_with_the_codes_and_kept_on_growth():
    cache = KVCache(2, 2, 64, 40, KVMode.parse("q8"))
    cache.write(0, 0, torch.randn(2, 40, 64), torch.randn(2, 40, 64))
    cache.reserve(100)
    cache.write(0, 40, torch.randn(2, 5, 64), torch.randn(2, 5, 64))
    k = cache.k[0]
    want = k.data[:, :45].to(torch.int32).view(2, 45, 2, 32).sum(-1)
    assert torch.equal(k.ksum[:, :45].to(torch.int32), want)
    assert cache.v[0].ksum is None  # V needs none


FULL = {"avx512f", "avx512bw", "avx512vl", "avx512vnni", "avx2", "avx"}


@pytest.mark.parametrize(
    "features,path",
    [
        (FULL, "vnni512"),
        (FULL - {"avx512bw"}, "vnni256"),  # 512-bit VNNI needs BW; VL + VNNI still give 256-bit
        ({"avxvnni", "avx2", "avx"}, "vnni256"),  # Alder Lake style AVX-VNNI
        (FULL - {"avx512vnni"}, "avx2"),
        ({"avx2"}, "avx2"),
        ({"avxvnni"}, "portable"),  # AVX-VNNI without AVX2 is no path of ours
        (set(), "portable"),
        ({"avx512vnni": True, "avx512bw": True, "avx512f": True, "avx2": False}, "vnni512"),
        ({"avx512vnni": False, "avx512bw": True, "avx512f": True, "avx2": True}, "avx2"),
    ],
)
def test_dispatch_from_features(features, path):
    assert intdot.choose_path(features) == path


def test_forced_path_env_and_refusals(monkeypatch):
    assert IntAttn(8).resolved_path({"avx2": True}) == "avx2"
    monkeypatch.setenv(cpu_int.PATH_ENV, "portable")
    assert IntAttn(8).resolved_path(dict.fromkeys(FULL, True)) == "portable"
    assert IntAttn(8, "avx2").resolved_path({"avx2": True}) == "avx2"  # explicit beats the env var
    with pytest.raises(ValueError, match="lacks"):
        IntAttn(8, "vnni512").resolved_path({"avx2": True})
    monkeypatch.setenv(cpu_int.PATH_ENV, "sse9")
    with pytest.raises(ValueError, match="KVLENS_INT_PATH"):
        IntAttn(16).resolved_path({})
    with pytest.raises(ValueError, match="8 or 16"):
        IntAttn(4)


def test_backend_names():
    assert IntAttn.parse("numba-int") == IntAttn(8) and IntAttn.parse("numba-int16:avx2") == IntAttn(
        16, "avx2"
    )
    assert IntAttn.parse("numba") is None and IntAttn(16, "portable").backend == "numba-int16:portable"
    assert resolve_backend("numba-int:portable", CPU) == "numba-int:portable"
    with pytest.raises(BackendError, match="unknown integer attention path"):
        resolve_backend("numba-int:sse9", CPU)
    with pytest.raises(BackendError, match="int8 K cache"):
        make_attend(KVCache(1, 1, 64, 8, KVMode.parse("f16")), prefill=False, backend="numba-int")
    with pytest.raises(ValueError, match="int8 K store"):
        decode_attention_int(
            torch.zeros(2, 64),
            RowStore.empty(StoreKind.F32, 1, 32, 64, CPU),
            RowStore.empty(StoreKind.F32, 1, 32, 64, CPU),
            1,
        )


def test_pinned_numba_target_limits_the_paths(monkeypatch):
    """NUMBA_CPU_NAME=generic (CI's baseline) compiles without CPU features: only the portable path may
    be chosen, whatever this CPU has (a VNNI function would fail to compile there)."""
    monkeypatch.setattr(numba.core.config, "CPU_FEATURES", "")
    intdot.host_features.cache_clear()
    try:
        assert intdot.host_features() == frozenset()
        assert IntAttn(8).resolved_path() == "portable"
        monkeypatch.setattr(numba.core.config, "CPU_FEATURES", "+avx2,+avx,-avx512vnni")
        intdot.host_features.cache_clear()
        assert intdot.host_features() == {"avx2", "avx"} and IntAttn(16).resolved_path() == "avx2"
    finally:
        monkeypatch.undo()
        intdot.host_features.cache_clear()


def pv8_rule(q_used, kf, vs, length):
    """Integer P.V by its documented rule, in float64: per tile of 32 positions and query head the
    weights w (softmax, V step folded in) become round-half-up(255 w / max_t w) times a step of
    max_t w / 255, times the V codes. Returns (output, tolerance for near-ties): a weight within
    1e-3 of a rounding tie may round either way in the kernel's f32, one step times |v code| each."""
    group = q_used.shape[0] // kf.shape[0]
    s = torch.einsum("hd,hld->hl", q_used, kf.repeat_interleave(group, 0)) / math.sqrt(q_used.shape[1])
    w = torch.softmax(s, -1) * (vs.scale[:, :length].double() / 127).repeat_interleave(group, 0)
    v8 = vs.data[:, :length].double().repeat_interleave(group, 0)
    out = torch.zeros(q_used.shape, dtype=torch.float64)
    tie_tol = torch.zeros(q_used.shape, dtype=torch.float64)
    for t0 in range(0, length, 32):
        wt, vt = w[:, t0 : t0 + 32], v8[:, t0 : t0 + 32]
        step = wt.amax(-1, keepdim=True) / 255
        x = wt / step
        out += step * torch.einsum("hj,hjd->hd", torch.floor(x + 0.5), vt)
        near = ((x - torch.floor(x)) - 0.5).abs() < 1e-3
        tie_tol += step * torch.einsum("hj,hjd->hd", near.double(), vt.abs())
    return out, tie_tol


@pytest.mark.parametrize("qbits", [8, 16])
@pytest.mark.parametrize("path", PATH_PARAMS)
@pytest.mark.parametrize("n_heads,n_kv,hd,length", [(8, 2, 128, 1000), (9, 3, 64, 33), (4, 4, 256, 1)])
def test_integer_pv_matches_its_rule_in_float64(path, qbits, n_heads, n_kv, hd, length):
    ks, vs = make_stores(n_kv, hd, length, seed=length)
    q = torch.randn(n_heads, hd, generator=torch.Generator().manual_seed(hd)) * 2
    out = decode_attention_int(q, ks, vs, length, spec=IntAttn(qbits, path, pv8=True)).double()
    kf = dequantize_q8(ks.data[:, :length], ks.scale[:, :length]).double()
    vf = dequantize_q8(vs.data[:, :length], vs.scale[:, :length]).double()
    codes, step = quantized_query(q, qbits)
    ref, tie_tol = pv8_rule(codes * step, kf, vs, length)
    f32 = 2e-5 * float(ref.abs().max())  # f32 scores and sums (8-bit query: f32 lane sums), headroom
    assert bool(((out - ref).abs() <= tie_tol + f32).all()), float(((out - ref).abs() - tie_tol).max())
    exact = reference_attention((codes * step)[:, None], kf, vf)[:, 0]  # P.V in float: the cost
    assert float((out - exact).abs().max()) > 10 * f32 or length == 1  # the weights really are 8-bit
    if qbits == 16:  # every sum is an exact integer: all paths give the same bits
        want = decode_attention_int(q, ks, vs, length, spec=IntAttn(16, "portable", pv8=True))
        assert torch.equal(out.float(), want)


def test_integer_pv_names_and_refusal():
    assert IntAttn.parse("numba-int16+pv8:avx2") == IntAttn(16, "avx2", pv8=True)
    assert IntAttn(8, None, pv8=True).backend == "numba-int+pv8"
    ks = RowStore.empty(Q8, 1, 32, 64, CPU, with_ksum=True)
    with pytest.raises(ValueError, match="int8 V store"):
        decode_attention_int(
            torch.zeros(1, 64),
            ks,
            RowStore.empty(StoreKind.F16, 1, 32, 64, CPU),
            1,
            spec=IntAttn(16, pv8=True),
        )

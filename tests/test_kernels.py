"""Fused decode kernels (numba CPU, Triton) against the float64 reference attention.

Every case fills the store beyond ``length`` with huge garbage, so reading one row too many fails.
Most cases run numba and torch single-threaded (the split/merge code still runs: the (kv_head, split)
items just execute in turn); ``test_parallel_path`` covers the multi-threaded launch.
"""

from __future__ import annotations

import importlib.util
import math
import sys

import numba
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlens.kernels import cpu
from kvlens.kernels.reference import reference_attention
from kvlens.kv.cache import RowStore
from kvlens.kv.modes import StoreKind
from kvlens.kv.quant import dequantize_q8

HAS_TRITON = importlib.util.find_spec("triton") is not None

CPU = torch.device("cpu")
GQA = [(4, 4), (9, 3), (8, 2), (16, 2)]  # (n_heads, n_kv): ratios 1, 3, 4, 8
LENGTHS = [1, 31, 32, 33, 1000]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny problems run on one thread


def make_store(
    kind: str, n_kv: int, cap: int, hd: int, length: int, gen: torch.Generator, zero_rows=()
) -> RowStore:
    """A store with rows [0, length) random (per-row magnitudes vary) and garbage beyond."""
    store = RowStore.empty(StoreKind(kind), n_kv, cap, hd, CPU)
    rows = torch.randn(n_kv, length, hd, generator=gen) * torch.rand(n_kv, length, 1, generator=gen) * 4
    for t in zero_rows:
        rows[:, t] = 0.0
    store.write(0, rows)
    if cap > length:  # garbage: would dominate (or overflow) the softmax if read
        if kind == "q8":
            store.data[:, length:] = 127
            store.scale[:, length:] = 1e6
        else:
            store.data[:, length:] = 3e4
    return store


def store_values(store: RowStore, length: int) -> torch.Tensor:
    """What attention must see, in float64 (int8 rows through the seed's dequantization)."""
    if store.kind == "q8":
        return dequantize_q8(store.data[:, :length], store.scale[:, :length]).double()
    return store.data[:, :length].double()


def reference(q: torch.Tensor, ks: RowStore, vs: RowStore, length: int) -> torch.Tensor:
    return reference_attention(q.double()[:, None], store_values(ks, length), store_values(vs, length))[:, 0]


def assert_matches(out, ref: torch.Tensor, rtol: float = 1e-5) -> None:
    out = torch.as_tensor(out).double()
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=rtol, atol=rtol * float(ref.abs().max()))


def case(kind_k, kind_v, n_heads, n_kv, hd, length, cap=None, seed=0, zero_rows=()):
    gen = torch.Generator().manual_seed(seed)
    cap = cap or (length + 40)
    ks = make_store(kind_k, n_kv, cap, hd, length, gen, zero_rows)
    vs = make_store(kind_v, n_kv, cap, hd, length, gen, zero_rows)
    q = torch.randn(n_heads, hd, generator=gen) * 2
    return q, ks, vs


# ---------------------------------------------------------------- numba CPU kernels


@pytest.mark.parametrize("n_splits", [None, 1, 3, 7])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("n_heads,n_kv", GQA)
def test_q8_matches_reference(n_heads, n_kv, hd, length, n_splits):
    q, ks, vs = case("q8", "q8", n_heads, n_kv, hd, length)
    assert_matches(cpu.decode_attention(q, ks, vs, length, n_splits=n_splits), reference(q, ks, vs, length))


@pytest.mark.parametrize("n_splits", [None, 2, 5])
@pytest.mark.parametrize("length", [1, 33, 1000])
@pytest.mark.parametrize("n_heads,n_kv", GQA)
@pytest.mark.parametrize(
    "kind_k,kind_v", [("f32", "f32"), ("f16", "f16"), ("bf16", "bf16"), ("q8", "f32"), ("f32", "q8")]
)
def test_store_kinds_match_reference(kind_k, kind_v, n_heads, n_kv, length, n_splits):
    q, ks, vs = case(kind_k, kind_v, n_heads, n_kv, 64, length, seed=1)
    assert_matches(cpu.decode_attention(q, ks, vs, length, n_splits=n_splits), reference(q, ks, vs, length))


def test_f16_bf16_bit_conversion_is_exact():
    """The in-kernel f16/bf16 -> f32 conversions are exact: subnormals, signed zeros, extremes."""
    f16 = [0.0, -0.0, 6e-8, -6e-8, 3e-5, -1e-7, 65504.0, -65504.0, 1.0, -2.5]
    for kind, vals in (("f16", f16), ("bf16", [*f16, 1e38, -3e-38, 1e-40])):
        ks, vs = (
            RowStore.empty(StoreKind(kind), 1, 32, 64, CPU),
            RowStore.empty(StoreKind(kind), 1, 32, 64, CPU),
        )
        row = torch.tensor(vals).to(vs.data.dtype)
        vs.data[0, 0, : len(vals)] = row
        out = cpu.decode_attention(torch.randn(2, 64), ks, vs, 1)  # one position: output = its V row
        assert torch.equal(out[:, : len(vals)], row.float().expand(2, -1))


@pytest.mark.parametrize("kind", ["q8", "f32", "f16"])
def test_all_zero_rows(kind):
    q, ks, vs = case(kind, kind, 9, 3, 64, 100, zero_rows=(0, 31, 32, 33, 99))
    assert_matches(cpu.decode_attention(q, ks, vs, 100, n_splits=4), reference(q, ks, vs, 100))
    # An all-zero cache: every score is 0, the output is exactly 0.
    zk, zv = RowStore.empty(StoreKind(kind), 3, 64, 64, CPU), RowStore.empty(StoreKind(kind), 3, 64, 64, CPU)
    assert torch.equal(cpu.decode_attention(q, zk, zv, 64), torch.zeros(9, 64))


def test_peaked_softmax_and_large_scores():
    """Scores in the hundreds (one key dominates) and splits whose maxima differ wildly."""
    q, ks, vs = case("q8", "q8", 8, 2, 128, 1000, seed=3)
    ks.data[:, 700] = 127
    ks.scale[:, 700] = 50.0
    q = q.abs() * 10
    assert_matches(cpu.decode_attention(q, ks, vs, 1000, n_splits=6), reference(q, ks, vs, 1000))


@pytest.mark.parametrize("direction", [1, -1])
def test_running_max_moves_by_more_and_less_than_the_lazy_threshold(direction):
    """Scores ramping by ~0.5 per position (the max creeps up below LAZY_MAX per tile, then jumps past
    it at tile boundaries) or falling: the lazily moved running max must not change the result."""
    length, hd = 700, 64
    q, ks, vs = case("f32", "q8", 6, 2, hd, length, seed=5)
    q = torch.ones(6, hd)
    ramp = direction * (torch.arange(length, dtype=torch.float32) - length / 2) * 0.5 / math.sqrt(hd)
    ks.data[:, :length] = ramp[None, :, None] * torch.linspace(0.5, 1.5, hd)  # scores ~ -175 .. +175
    for n_splits in (1, 4):
        assert_matches(
            cpu.decode_attention(q, ks, vs, length, n_splits=n_splits), reference(q, ks, vs, length)
        )


@pytest.mark.parametrize("length", [1, 33, 1000])
@pytest.mark.parametrize("n_heads,n_kv", [(9, 3), (32, 8)])
def test_intdot_matches_reference_with_quantized_query(n_heads, n_kv, length):
    """The seed's variant is exact up to f32 rounding *given its int8 query*, and close to the f32 query."""
    q, ks, vs = case("q8", "q8", n_heads, n_kv, 64, length, seed=4)
    out = cpu.decode_attention(q, ks, vs, length, n_splits=3, int_dot=True)
    q8, q_max = cpu.quantize_query_blocks(q.numpy())
    q_used = dequantize_q8(torch.from_numpy(q8).view(n_heads, -1, 32), torch.from_numpy(q_max)).view(
        n_heads, 64
    )
    assert_matches(out, reference(q_used, ks, vs, length))
    assert_matches(out, reference(q, ks, vs, length), rtol=0.05)


def test_parallel_path():
    """All threads, default splits (several per KV head), long enough to take the parallel path."""
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    q, ks, vs = case("q8", "q8", 32, 8, 128, 3000, seed=5)
    assert cpu.choose_splits(3000, 8, 16) > 1
    ref = reference(q, ks, vs, 3000)
    assert_matches(cpu.decode_attention(q, ks, vs, 3000), ref)
    assert_matches(cpu.decode_attention(q, ks, vs, 3000, n_splits=5), ref)


def test_errors():
    q, ks, vs = case("q8", "q8", 4, 2, 64, 10, cap=32)
    with pytest.raises(ValueError, match="length"):
        cpu.decode_attention(q, ks, vs, 0)
    with pytest.raises(ValueError, match="length"):
        cpu.decode_attention(q, ks, vs, 33)
    with pytest.raises(ValueError, match="shape"):
        cpu.decode_attention(torch.zeros(3, 64), ks, vs, 10)
    fk = RowStore.empty(StoreKind.F32, 2, 32, 64, CPU)
    with pytest.raises(ValueError, match="int_dot"):
        cpu.decode_attention(q, fk, vs, 10, int_dot=True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_kv=st.integers(1, 4),
    group=st.sampled_from([1, 2, 3, 4, 8]),
    hd=st.sampled_from([32, 64, 96, 128]),
    length=st.integers(1, 300),
    extra=st.integers(0, 70),
    n_splits=st.one_of(st.none(), st.integers(1, 12)),
    kinds=st.sampled_from([("q8", "q8"), ("f32", "f32"), ("f16", "f16"), ("bf16", "bf16"), ("q8", "f16")]),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(n_kv, group, hd, length, extra, n_splits, kinds, seed):
    q, ks, vs = case(*kinds, n_kv * group, n_kv, hd, length, cap=length + extra, seed=seed)
    assert_matches(cpu.decode_attention(q, ks, vs, length, n_splits=n_splits), reference(q, ks, vs, length))


# ---------------------------------------------------------------- Triton (interpreter on CPU)

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")


@pytest.fixture
def triton_interpret(monkeypatch):
    """Without a GPU, run Triton's interpreter. kvlens.kernels.gpu decorates its kernel on first use,
    so the variable only has to be set by then; it is unset again after each test."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def on_triton_device(*stores: RowStore) -> list[RowStore]:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return [RowStore(s.kind, s.data.to(dev), None if s.scale is None else s.scale.to(dev)) for s in stores]


@needs_triton
@pytest.mark.parametrize(
    "kind_k,kind_v,n_heads,n_kv,hd,length,n_splits",
    [
        ("q8", "q8", 9, 3, 64, 33, None),
        ("q8", "q8", 8, 1, 128, 70, 3),  # ratio 8, splits not dividing the length
        ("q8", "q8", 4, 4, 64, 1, 2),  # an empty split
        ("q8", "q8", 8, 2, 96, 32, 1),  # head_dim padded to 128 inside the kernel
        ("f32", "f32", 8, 2, 64, 31, 2),
        ("f16", "f16", 9, 3, 64, 40, None),
        ("bf16", "bf16", 4, 1, 64, 17, 1),
        ("q8", "f32", 8, 2, 64, 50, 2),
    ],
)
def test_triton_matches_reference(triton_interpret, kind_k, kind_v, n_heads, n_kv, hd, length, n_splits):
    from kvlens.kernels.gpu import decode_attention_triton

    q, ks, vs = case(kind_k, kind_v, n_heads, n_kv, hd, length, seed=6)
    out = decode_attention_triton(q, *on_triton_device(ks, vs), length, n_splits=n_splits, block_n=16)
    assert_matches(out.cpu(), reference(q, ks, vs, length))


@needs_triton
def test_triton_zero_rows_and_errors(triton_interpret):
    from kvlens.kernels.gpu import decode_attention_triton

    q, ks, vs = case("q8", "q8", 4, 2, 64, 20, zero_rows=(0, 5, 19), seed=7)
    out = decode_attention_triton(q, *on_triton_device(ks, vs), 20, n_splits=3, block_n=16)
    assert_matches(out.cpu(), reference(q, ks, vs, 20))
    with pytest.raises(ValueError, match="length"):
        decode_attention_triton(q, ks, vs, 0)
    with pytest.raises(ValueError, match="block_n"):
        decode_attention_triton(q, ks, vs, 5, block_n=24)


def test_triton_missing_gives_a_clear_error(triton_interpret, monkeypatch):
    from kvlens.kernels import gpu

    gpu._kernels.cache_clear()
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    q, ks, vs = case("q8", "q8", 4, 2, 64, 5)
    with pytest.raises(gpu.TritonUnavailableError, match="pip install triton"):
        gpu.decode_attention_triton(q, ks, vs, 5)
    gpu._kernels.cache_clear()


def test_sanity_of_reference_helper():
    """The f64 reference helper itself: one key means the output is that key's V row."""
    q, ks, vs = case("f32", "f32", 4, 2, 64, 1)
    ref = reference(q, ks, vs, 1)
    assert torch.allclose(ref, vs.data[:, 0].double().repeat_interleave(2, 0))
    assert math.isclose(float(ref.abs().max()), float(vs.data[:, 0].abs().max()), rel_tol=1e-6)
    # ... and the garbage beyond ``length`` is loud: one row too many changes everything.
    q, ks, vs = case("q8", "q8", 4, 2, 64, 10)
    q = q.abs()  # positive scores against the all-127 garbage keys
    assert (cpu.decode_attention(q, ks, vs, 11) - reference(q, ks, vs, 10)).abs().max() > 1.0

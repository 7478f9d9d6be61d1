"""Sliding windows read in place by the fused decode kernels (``window=``; kernels.reference.sliding_window):
the query at ``length - 1`` attends positions ``length - window ..`` through the tiles they cover, the
rows below the window's first position skipped, nothing copied; contiguous and paged, every kernel.

Each case plants garbage in the stored rows below the window (and beyond the length), so a kernel that
reads one of them fails. The reference is float64 attention over the window's rows as the store
dequantizes them.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_int_attention import EPS32, quantized_query
from test_paged_kv import filled
from test_sink_store import assert_close, filled_store, read_logical

from kvlens.engine.attention import make_attend
from kvlens.kernels import cpu
from kvlens.kernels.cpu_int import IntAttn, decode_attention_int
from kvlens.kernels.reference import reference_attention, sliding_window
from kvlens.kv.cache import RowStore
from kvlens.kv.quant import rotate_rows, rotation

pytestmark = pytest.mark.usefixtures("one_thread")

# (length, window): windows starting inside a tile, on a tile edge, one position, and holding it all
CASES = [(100, 37), (75, 43), (96, 64), (41, 40), (33, 1), (20, 64)]


def window_case(kind: str, n_heads: int, n_kv: int, hd: int, length: int, window: int, table=None, seed=0):
    """(q, K store, V store, float64 K and V of the window as attention must see them); garbage in the
    stores below the window's first position."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(n_kv, length, hd, generator=gen) * 3 for _ in "kv")
    lo = max(0, length - window)
    ks, vs = filled_store(kind, k, lo, table), filled_store(kind, v, lo, table)
    k_ref, v_ref = (read_logical(s, length, table)[:, lo:].double() for s in (ks, vs))
    return torch.randn(n_heads, hd, generator=gen) * 2, ks, vs, k_ref, v_ref


def reference(q: torch.Tensor, k_ref: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    return reference_attention(q.double()[:, None], k_ref, v_ref)[:, 0]


@pytest.mark.parametrize("kind", ["q8", "q4h", "q6h", "f16", "bf16"])
@pytest.mark.parametrize("hd", [64, 256])
def test_kernel_reads_only_the_window(kind, hd):
    for (length, window), (n_heads, n_kv) in zip(CASES, [(4, 1), (6, 2)] * 3, strict=True):
        q, ks, vs, k_ref, v_ref = window_case(kind, n_heads, n_kv, hd, length, window, seed=length)
        for n_splits in (1, 3):
            out = cpu.decode_attention(q, ks, vs, length, n_splits=n_splits, window=window)
            assert_close(out, reference(q, k_ref, v_ref), 1e-5)


@pytest.mark.parametrize("window", [37, 64, 90])
def test_paged_kernel_reads_the_window_through_the_table(window):
    table = [2, 0, 3, 1]
    q, ks, vs, k_ref, v_ref = window_case("q4h", 6, 2, 64, 120, window, table=table, seed=window)
    for n_splits in (1, 3):
        out = cpu.decode_attention(q, ks, vs, 120, n_splits=n_splits, table=table, window=window)
        assert_close(out, reference(q, k_ref, v_ref), 1e-5)


@pytest.mark.parametrize("kind", ["q8", "q4h"])
def test_integer_kernel_reads_only_the_window(kind):
    """numba-int16 (q8 K) and numba-int (4-bit K): float64 attention over the scores they are defined
    to compute (the query quantized by its documented rule), f32 rounding apart (bounded as in
    test_sink_store.test_integer_kernel_reads_the_sink)."""
    spec = IntAttn.parse("numba-int16" if kind == "q8" else "numba-int")
    for length, window in CASES:
        q, ks, vs, k_ref, v_ref = window_case(kind, 6, 2, 64, length, window, seed=length)
        if kind == "q8":
            ks.ksum = torch.zeros(2, ks.capacity, 2, dtype=torch.int16)  # the int16 query reads no sums
        codes, step = quantized_query(q, spec.qbits)
        kg, vg = k_ref.repeat_interleave(3, 0), v_ref.repeat_interleave(3, 0)  # GQA group of 3
        scores = torch.einsum("hd,hld->hl", codes * step, kg) / math.sqrt(64)
        ref = torch.einsum("hl,hld->hd", torch.softmax(scores, dim=1), vg)
        mag = torch.einsum("hd,hld->hl", (codes * step).abs(), kg.abs()) / math.sqrt(64)
        bound = (64 / 8 + 3) * EPS32 * float(mag.max()) * 2
        atol = 1e-5 * float(ref.abs().max()) + 2.5 * bound * float(v_ref.abs().max())
        for n_splits in (1, 3):
            out = decode_attention_int(q, ks, vs, length, n_splits=n_splits, spec=spec, window=window)
            torch.testing.assert_close(out.double(), ref, rtol=0, atol=atol)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernel_reads_only_the_window(monkeypatch):
    """The Triton kernel (its interpreter without a GPU), contiguous and paged."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kvlens.kernels.gpu import decode_attention_triton

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def run(ks, vs, length, **kw):
        ks, vs = (
            RowStore(s.kind, s.data.to(dev), None if s.scale is None else s.scale.to(dev)) for s in (ks, vs)
        )
        return decode_attention_triton(q.to(dev), ks, vs, length, **kw).cpu()

    for kind, (length, window), n_splits in [
        ("q8", (100, 37), 2),
        ("q4h", (75, 43), 1),
        ("f16", (41, 40), 3),
    ]:
        q, ks, vs, k_ref, v_ref = window_case(kind, 6, 2, 64, length, window, seed=length)
        out = run(ks, vs, length, n_splits=n_splits, block_n=16, window=window)
        assert_close(out, reference(q, k_ref, v_ref), 1e-5)
    table = [2, 0, 3, 1]
    q, ks, vs, k_ref, v_ref = window_case("q6h", 4, 2, 64, 120, 50, table=table)
    assert_close(run(ks, vs, 120, table=torch.tensor(table), window=50), reference(q, k_ref, v_ref), 1e-5)


def test_a_window_refuses_blocks_sink_and_bad_sizes():
    q, ks, vs, *_ = window_case("q8", 4, 1, 64, 100, 37)
    rows = (torch.zeros(1, 2, 64), torch.zeros(1, 2, 64))
    with pytest.raises(ValueError, match="no sparse blocks and no sink"):
        cpu.decode_attention(q, ks, vs, 100, window=37, blocks=torch.tensor([[0, 2]]))
    with pytest.raises(ValueError, match="no sparse blocks and no sink"):
        cpu.decode_attention(q, ks, vs, 100, window=37, sink=rows)
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="window must be a positive int"):
            cpu.decode_attention(q, ks, vs, 100, window=bad)
    # a window that still holds every position is no window: sink and blocks as ever
    assert sliding_window(1, 100, 100, None, rows, 32) == (None, 0)
    blocks, first = sliding_window(2, 100, 37, None, None, 32)
    assert first == 63 and blocks.tolist() == [[1, 2, 3]] * 2


@pytest.mark.parametrize("backend", ["numba", "numba-int"])
@pytest.mark.parametrize("mode", ["q8", "q4h"])
def test_paged_engine_step_reads_the_window_alike(mode, backend):
    """make_attend over a sequence's paged view (its blocks scattered in the pool, garbage elsewhere)
    gives what it gives over a contiguous cache of the same rows, and the float64 windowed attention."""
    _, seq, _, cache = filled(mode, 150)
    gen = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(6, 1, 64, generator=gen), *(torch.randn(2, 1, 64, generator=gen) for _ in "kv")
    seq.grow(151)
    outs = [make_attend(c, False, backend, 40)(0, q, k, v, 150) for c in (seq, cache)]
    assert torch.equal(outs[0], outs[1])
    if backend == "numba":  # numba-int scores with its quantized query: the equality above is its check
        k_all, v_all = cache.read(0, 151)
        k_span, v_span = (s.kind.rotation_span(64) for s in (cache.k[0], cache.v[0]))
        qs = rotate_rows(q, k_span) if k_span else q
        ref = reference_attention(qs.double(), k_all[:, -40:].double(), v_all[:, -40:].double())
        if v_span:
            ref = ref @ rotation(64, torch.float64, span=v_span).T
        assert_close(outs[1][:, 0], ref[:, 0], 1e-5)


@settings(max_examples=60, deadline=None)
@given(
    length=st.integers(1, 200),
    window=st.integers(1, 220),
    heads=st.sampled_from([(1, 1), (3, 1), (4, 2)]),
    kind=st.sampled_from(["q8", "q4h", "f16"]),
    n_splits=st.integers(1, 4),
    paged=st.booleans(),
)
def test_any_window_reads_exactly_its_rows(length, window, heads, kind, n_splits, paged):
    """Any length, window (shorter, equal or longer), GQA group, kind, split count and block layout:
    the kernel attends exactly the last min(window, length) positions (garbage planted below them)."""
    n_heads, n_kv = heads
    n_blocks = -(-length // 32)
    table = list(range(n_blocks))[::-1] if paged else None  # logical block j in physical n_blocks-1-j
    q, ks, vs, k_ref, v_ref = window_case(kind, n_heads, n_kv, 64, length, window, table=table, seed=length)
    out = cpu.decode_attention(q, ks, vs, length, n_splits=n_splits, table=table, window=window)
    assert_close(out, reference(q, k_ref, v_ref), 1e-5)

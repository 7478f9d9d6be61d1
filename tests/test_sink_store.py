"""The sink store (kv.cache; a recipe's ``keep_sink``): the first S positions of every layer kept in
f16 beside the quantized rows, and read in their place by the torch path and the CPU kernels.

Kernel cases plant garbage in the quantized rows of the sink positions (and beyond the length), so a
kernel that reads those rows instead of the sink rows fails. The reference is float64 attention over
the sink rows as f16 and the other rows as the store dequantizes them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math

import pytest
import torch
from bounds import f32_forward_tol
from test_int_attention import EPS32, quantized_query

from kvlens.engine.attention import make_attend
from kvlens.kernels import cpu
from kvlens.kernels.cpu_int import IntAttn, decode_attention_int
from kvlens.kernels.reference import reference_attention
from kvlens.kv.cache import KVCache, RowStore
from kvlens.kv.modes import MODES, CacheOptions, KVMode, StoreKind
from kvlens.kv.quant import rotation
from kvlens.kv.recipe import RecipeError, load_recipe, parse_recipe, recipe_json

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
GARBAGE = 3e4  # a row of these would dominate any softmax (K) or output (V) it entered


def physical(pos: int, table: list[int] | None) -> int:
    return pos if table is None else table[pos // 32] * 32 + pos % 32


def filled_store(kind: str, rows: torch.Tensor, sink: int, table: list[int] | None) -> RowStore:
    """A store holding ``rows [n_kv, n, hd]`` (logical positions; through ``table`` if given), the
    sink positions' rows replaced by garbage, garbage beyond ``n`` too."""
    n_kv, n, hd = rows.shape
    cap = 32 * (len(table) if table else -(-(n + 40) // 32))
    store = RowStore.empty(StoreKind(kind), n_kv, cap, hd, CPU)
    store.write(0, torch.full((n_kv, cap, hd), GARBAGE))
    for pos in range(sink, n):
        store.write(physical(pos, table), rows[:, pos : pos + 1])
    return store


def read_logical(store: RowStore, n: int, table: list[int] | None) -> torch.Tensor:
    return torch.cat([store.read(physical(p, table), physical(p, table) + 1) for p in range(n)], dim=1)


def sink_case(kind: str, n_heads: int, n_kv: int, hd: int, length: int, sink: int, table=None, seed=0):
    """(q, K store, V store, sink rows, float64 K and V as attention must see them)."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (
        torch.randn(n_kv, length, hd, generator=gen) * torch.rand(n_kv, length, 1, generator=gen) * 4
        for _ in "kv"
    )
    k[:, 0] *= 8  # a sink-like first key: large, so its rounding matters
    s = min(sink, length)
    ks, vs = filled_store(kind, k, s, table), filled_store(kind, v, s, table)
    rows = (k[:, :s].half().float(), v[:, :s].half().float())
    k_ref, v_ref = (
        torch.cat([r.double(), read_logical(st, length, table)[:, s:].double()], dim=1)
        for r, st in zip(rows, (ks, vs), strict=True)
    )
    q = torch.randn(n_heads, hd, generator=gen) * 2
    return q, ks, vs, rows, k_ref, v_ref


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=rel * float(ref.abs().max()))


@pytest.mark.parametrize("kind", ["q8", "q4h", "q6h", "f16"])
@pytest.mark.parametrize("hd", [64, 256])
@pytest.mark.parametrize("sink", [1, 5, 40])
def test_kernel_reads_the_sink_rows_and_skips_their_codes(kind, hd, sink):
    for (n_heads, n_kv), length, n_splits in [
        ((6, 2), 1, 1), ((6, 2), 5, 2), ((4, 1), 32, 1), ((4, 1), 33, 3), ((6, 2), 41, 2), ((6, 2), 100, 3),
    ]:  # fmt: skip
        q, ks, vs, rows, k_ref, v_ref = sink_case(kind, n_heads, n_kv, hd, length, sink, seed=length)
        ref = reference_attention(q.double()[:, None], k_ref, v_ref)[:, 0]
        out = cpu.decode_attention(q, ks, vs, length, n_splits=n_splits, sink=rows)
        assert_close(out, ref, 1e-5)


@pytest.mark.parametrize("sink", [1, 33])
def test_paged_kernel_reads_the_sink(sink):
    table = [2, 0, 3, 1]
    q, ks, vs, rows, k_ref, v_ref = sink_case("q4h", 4, 2, 64, 120, sink, table=table)
    ref = reference_attention(q.double()[:, None], k_ref, v_ref)[:, 0]
    for n_splits in (1, 3):
        assert_close(
            cpu.decode_attention(q, ks, vs, 120, n_splits=n_splits, table=table, sink=rows), ref, 1e-5
        )


def sparse_reference(q: torch.Tensor, k_ref: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """Float64 attention of KV head 0 over blocks 0 and 2, KV head 1 over blocks 1 and 3 (120 rows)."""
    kept = [
        torch.cat([torch.arange(0, 32), torch.arange(64, 96)]),
        torch.cat([torch.arange(32, 64), torch.arange(96, 120)]),
    ]
    return torch.cat(
        [reference_attention(q[2 * h : 2 * h + 2].double()[:, None], k_ref[h : h + 1, kept[h]], v_ref[h : h + 1, kept[h]])
         for h in range(2)]
    )[:, 0]  # fmt: skip


def test_sparse_kernel_attends_the_sink_with_block_0_only():
    """A KV head whose selected blocks include block 0 attends the sink rows; one whose blocks leave
    it out does not (as the torch path's block mask)."""
    q, ks, vs, rows, k_ref, v_ref = sink_case("q8", 4, 2, 64, 120, 3)
    blocks = torch.tensor([[0, 2], [1, 3]])
    assert_close(
        cpu.decode_attention(q, ks, vs, 120, blocks=blocks, sink=rows),
        sparse_reference(q, k_ref, v_ref),
        1e-5,
    )


@pytest.mark.parametrize("kind", ["q8", "q4h"])
def test_integer_kernel_reads_the_sink(kind):
    """numba-int16 (q8 K) and numba-int (4-bit K) score the sink rows with the exact query and the other
    rows with the query quantized by its documented rule (test_int_attention.quantized_query): against
    float64 attention over exactly those scores only f32 rounding differs (bounded as in
    test_q4_int_attention: hd/8 + 3 rounded terms per score, x2 headroom)."""
    spec = IntAttn.parse("numba-int16" if kind == "q8" else "numba-int")
    for length, sink in [(3, 5), (40, 1), (100, 5)]:
        q, ks, vs, rows, k_ref, v_ref = sink_case(kind, 6, 2, 64, length, sink, seed=length)
        if kind == "q8":
            ks.ksum = torch.zeros(2, ks.capacity, 2, dtype=torch.int16)  # the int16 query reads no sums
        codes, step = quantized_query(q, spec.qbits)
        s = min(sink, length)
        kg, vg = k_ref.repeat_interleave(3, 0), v_ref.repeat_interleave(3, 0)  # GQA group of 3
        scores = torch.cat(
            [
                torch.einsum("hd,hld->hl", q.double(), kg[:, :s]),
                torch.einsum("hd,hld->hl", codes * step, kg[:, s:]),
            ],
            1,
        ) / math.sqrt(64)
        ref = torch.einsum("hl,hld->hd", torch.softmax(scores, dim=1), vg)
        mag = torch.einsum("hd,hld->hl", (codes * step).abs(), kg.abs()) / math.sqrt(64)
        bound = (64 / 8 + 3) * EPS32 * float(mag.max()) * 2
        vmax = float(v_ref.abs().max())
        for n_splits in (1, 3):
            out = decode_attention_int(q, ks, vs, length, n_splits=n_splits, spec=spec, sink=rows).double()
            atol = 1e-5 * float(ref.abs().max()) + 2.5 * bound * vmax
            torch.testing.assert_close(out, ref, rtol=0, atol=atol)


def test_cache_keeps_only_the_sink_rows_and_attends_them():
    """KVCache: S f16 rows per layer (no f32 copy of every row); the torch and numba decode steps
    equal the float64 attention over what the cache reads (sink rows spliced in), windowed or not."""
    gen = torch.Generator().manual_seed(1)
    mode = dataclasses.replace(MODES["q4h"], keep_sink=3)
    cache = KVCache(2, 2, 64, 100, mode)
    assert cache.sink == 3 and not cache.k_exact and cache.k_sink[0].capacity == 3
    k, v = (torch.randn(2, 70, 64, generator=gen) for _ in "kv")
    k[:, :3] *= 20  # sink rows that draw the attention: their 4-bit rounding would show
    cache.write(0, 0, k[:, :69], v[:, :69])
    rot = rotation(64, torch.float64, span=StoreKind.Q4H.rotation_span(64))
    for window in (None, 68, 16):  # 68: the window still reaches sink row 2; 16: no sink row
        q = k[:, 2:3].repeat_interleave(2, dim=0) / 20 + torch.randn(
            4, 1, 64, generator=gen
        )  # row 2 draws it
        outs = [
            make_attend(cache, False, backend, window)(0, q, k[:, 69:], v[:, 69:], 69)
            for backend in ("torch", "numba")
        ]
        k_all, v_all = cache.read(0, 70)
        ref = reference_attention(
            q.double() @ rot, k_all.double(), v_all.double(), torch.tensor([69]), window
        )
        for out in outs:
            assert_close(out[:, 0], (ref @ rot.T)[:, 0], 1e-5)
    plain = KVCache(2, 2, 64, 100, MODES["q4h"])
    plain.write(0, 0, k, v)
    assert not torch.equal(plain.read(0, 70)[0][:, :3], cache.read(0, 70)[0][:, :3])


def test_recipe_sink_round_trip_and_refusals(tmp_path):
    data = recipe_json(MODES["q8"], 2) | {"keep_sink": 4}
    mode = parse_recipe(data, "r.json")
    assert mode.keep_sink == 4 and recipe_json(mode, 2)["keep_sink"] == 4
    assert "keep_sink=4" in mode.identity and mode != parse_recipe(recipe_json(MODES["q8"], 2), "r.json")
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    assert load_recipe(path).keep_sink == 4
    for bad in (-1, 1.5, True, "4", None):
        with pytest.raises(RecipeError, match="keep_sink"):
            parse_recipe(data | {"keep_sink": bad}, "r.json")
    with pytest.raises(ValueError, match="keep_sink"):
        KVMode("x", StoreKind.Q8, StoreKind.Q8, keep_sink=-2)


def test_engine_decodes_a_sink_recipe_alike_on_both_paths(smol_f32):
    """Every position in the sink store: a q8 cache reads as an f16 one, prefill bit for bit, the
    numba decode step (sink rows into the kernel) within f32 rounding."""
    ids = smol_f32.tokenizer.encode("The capital of France is")
    n = len(ids)
    sink = dataclasses.replace(MODES["q8"], keep_sink=n + 1)
    outs = []
    for kv in (sink, MODES["f16"]):
        llm = smol_f32.variant(attn_backend="numba")
        cache = llm.new_cache(n + 1, kv=kv)
        outs.append((llm.prefill(ids, cache), llm.forward([ids[-1]], cache, n, prefill=False)))
    assert torch.equal(outs[0][0], outs[1][0])
    diff = (outs[0][1] - outs[1][1]).abs().max().item()
    assert diff <= 2 * f32_forward_tol(smol_f32.config, outs[1][1])
    with pytest.raises(ValueError, match="keep_sink"):
        CacheOptions(keep_sink=-1)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernel_reads_the_sink(monkeypatch):
    """The Triton kernel (its interpreter without a GPU): dense with 1-3 splits, paged, and sparse."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kvlens.kernels.gpu import decode_attention_triton

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def run(ks, vs, rows, length, **kw):
        ks, vs = (
            RowStore(s.kind, s.data.to(dev), None if s.scale is None else s.scale.to(dev)) for s in (ks, vs)
        )
        return decode_attention_triton(
            q.to(dev), ks, vs, length, sink=tuple(r.to(dev) for r in rows), **kw
        ).cpu()

    for kind, length, sink, n_splits in [("q8", 3, 5, 1), ("q4h", 70, 1, 3), ("f16", 40, 33, 2)]:
        q, ks, vs, rows, k_ref, v_ref = sink_case(kind, 6, 2, 64, length, sink, seed=length)
        ref = reference_attention(q.double()[:, None], k_ref, v_ref)[:, 0]
        assert_close(run(ks, vs, rows, length, n_splits=n_splits, block_n=16), ref, 1e-5)
    table = [2, 0, 3, 1]
    q, ks, vs, rows, k_ref, v_ref = sink_case("q6h", 4, 2, 64, 120, 3, table=table)
    ref = reference_attention(q.double()[:, None], k_ref, v_ref)[:, 0]
    assert_close(run(ks, vs, rows, 120, table=torch.tensor(table)), ref, 1e-5)
    q, ks, vs, rows, k_ref, v_ref = sink_case("q8", 4, 2, 64, 120, 3)
    blocks = torch.tensor([[0, 2], [1, 3]])
    assert_close(run(ks, vs, rows, 120, blocks=blocks), sparse_reference(q, k_ref, v_ref), 1e-5)

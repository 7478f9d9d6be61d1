"""The packed N-bit kinds (q7h, q6h, q5h): bit packing, the row rule at N bits, bytes, refusals,
recipes and the planner's choice among more than two candidates.

The kernels against float64 are in test_kv_rotated_q4 (its kind pairs include these kinds), the
paged pool in test_paged_kv (every registered mode), the disk tier in test_kv_disk. References
here are independent of the code: numpy's own bit packing, and the rule transcribed in numpy.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import mmap
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlens.engine.attention import BackendError
from kvlens.kernels.cpu_int import decode_attention_int
from kvlens.kv.cache import KVCache, RowStore
from kvlens.kv.modes import MODES, KVMode, StoreKind
from kvlens.kv.nbit import pack_bits, store_packed, unpack_bits
from kvlens.kv.quant import quantize_q8
from kvlens.kv.recipe import load_recipe, save_recipe
from kvlens.lab.plan import PlanConfig
from kvlens.lab.recipe_search import choose

TINY_MODEL = ("qwen3", 3)  # conftest's tiny_dir / tiny: 2 layers, 2 KV heads, head_dim 32
PACKED = ["q7h", "q6h", "q5h"]
CPU = torch.device("cpu")


def numpy_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Code i's two's-complement low ``bits`` bits at row bits [i*N, i*N+N), little-endian: numpy's
    packbits of the bit matrix."""
    u = codes.astype(np.int64) & ((1 << bits) - 1)
    bit_matrix = (u[..., None] >> np.arange(bits)) & 1
    return np.packbits(bit_matrix.reshape(*codes.shape[:-1], -1).astype(np.uint8), axis=-1, bitorder="little")


@settings(max_examples=30, deadline=None)
@given(
    bits=st.sampled_from([5, 6, 7]),
    hd=st.sampled_from([64, 128, 256]),
    rows=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_is_exact_and_the_documented_layout(bits, hd, rows, seed):
    rng = np.random.default_rng(seed)
    half = 1 << (bits - 1)
    codes = rng.integers(-half, half, size=(rows, hd)).astype(np.int8)
    codes[0, :2] = (-half, half - 1)  # the extreme codes
    packed = pack_bits(torch.from_numpy(codes), bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, hd * bits // 8)
    np.testing.assert_array_equal(packed.numpy(), numpy_pack(codes, bits))
    np.testing.assert_array_equal(unpack_bits(packed, bits).numpy(), codes)


def test_pack_refuses_codes_out_of_range_and_odd_widths():
    with pytest.raises(ValueError, match="5-bit codes must lie in -16..15"):
        pack_bits(torch.full((1, 8), 16, dtype=torch.int8), 5)
    with pytest.raises(ValueError, match="divisible by 8"):
        pack_bits(torch.zeros(1, 12, dtype=torch.int8), 6)


def numpy_rule(x: np.ndarray, bits: int, fp16: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The q8 rule at ``bits`` in numpy float32: qmax = 2^(N-1)-1, ``inv = qmax / max_abs`` (1.0 for a
    row under 1e-6), codes ``clip(floor(x * inv + 0.5), -qmax, qmax)``: round half up. ``fp16``: the
    packed kinds' max_abs, rounded to fp16 by numpy before the codes are made from it."""
    qmax = np.float32(2 ** (bits - 1) - 1)
    m = np.abs(x).max(-1)
    m = np.where(m < np.float32(1e-6), np.float32(1.0), m).astype(np.float32)
    if fp16:
        m = m.astype(np.float16).astype(np.float32)
    inv = (qmax / m).astype(np.float32)
    y = (x * inv[..., None]).astype(np.float32)
    return np.clip(np.floor(y + np.float32(0.5)), -qmax, qmax).astype(np.int8), m


@pytest.mark.parametrize("fp16", [False, True])
@pytest.mark.parametrize("bits", [5, 6, 7, 8])
def test_rule_is_the_q8_rule_with_its_qmax(bits, fp16):
    rng = np.random.default_rng(bits)
    x = (rng.standard_normal((5, 64)) * rng.uniform(0.01, 30, (5, 1))).astype(np.float32)
    x[1] = 0.0  # all zero: max_abs 1.0, codes 0
    x[2, 7] = -np.abs(x[2]).max() * 2  # the row's max is negative: code -qmax
    q, m = quantize_q8(torch.from_numpy(x), bits=bits, fp16_scale=fp16)
    q_ref, m_ref = numpy_rule(x, bits, fp16)
    assert m.dtype == (torch.float16 if fp16 else torch.float32)
    np.testing.assert_array_equal(q.numpy(), q_ref)
    np.testing.assert_array_equal(m.float().numpy(), m_ref)
    qmax = 2 ** (bits - 1) - 1
    assert q[1].abs().max() == 0 and m[1] == 1.0 and q[2, 7] == -qmax
    assert int(q.abs().max()) == qmax


def test_rule_by_hand_at_5_bits_ties_round_up():
    """max_abs 15 = qmax: inv = 1 exactly, so the codes are the values rounded half up, by hand."""
    x = torch.tensor([[15.0, 2.5, -2.5, 0.5, -0.5, -15.0, 14.5, -14.49]])
    q, m = quantize_q8(x, bits=5)
    assert q.tolist() == [[15, 3, -2, 1, 0, -15, 15, -14]] and float(m[0]) == 15.0


@pytest.mark.parametrize("bits", [5, 6, 7])
@pytest.mark.parametrize("hd", [64, 256])
def test_cpu_store_is_the_rule_then_the_packing_bit_for_bit(bits, hd):
    """The CPU write (one JIT pass, kernels.q8store.store_packed_rows) against the numpy rule and
    numpy's packbits: ties at x.5 steps, a zero row, a row under 1e-6, both signs at full scale."""
    rng = np.random.default_rng(bits * hd)
    x = (rng.standard_normal((2, 6, hd)) * 3).astype(np.float32)
    qmax = 2 ** (bits - 1) - 1
    x[0, 0] = (np.arange(hd) % (2 * qmax) - qmax + 0.5).astype(np.float32)  # -qmax+.5 .. qmax-.5
    x[0, 0, 0] = qmax  # max_abs = qmax exactly: inv 1, every other value a tie
    x[0, 1] = 0.0
    x[0, 2] = 1e-7
    x[1, 0, :2] = (-9.0, 9.0)
    store = RowStore.empty(StoreKind(f"q{bits}h"), 2, 16, hd, CPU)
    store.data.fill_(0xA5)
    # max_abs 1000.8 rounds to fp16 1001 (ulp 0.5 there), and the other values sit just under the
    # ties of steps of 1000.9/qmax: below a tie of the rounded scale's codes, above one of 1000.8's
    x[1, 1] = ((np.arange(hd) % qmax) + 0.5).astype(np.float32) * np.float32(1000.9 / qmax)
    x[1, 1, 5] = 1000.8
    store_packed(torch.from_numpy(x), store.data, store.scale, 3, bits)
    codes, m = numpy_rule(x, bits, fp16=True)
    assert store.scale.dtype == torch.float16 and float(store.scale[1, 4]) == 1001.0
    assert (codes[1, 1] != numpy_rule(x, bits)[0][1, 1]).sum() > hd // 4  # the rounding matters here
    np.testing.assert_array_equal(store.data[:, 3:9].numpy(), numpy_pack(codes, bits))
    np.testing.assert_array_equal(store.scale[:, 3:9].float().numpy(), m)
    assert (store.data[:, :3] == 0xA5).all() and (store.data[:, 9:] == 0xA5).all()  # nothing else written


@contextmanager
def before_a_guard_page(data: np.ndarray):
    """A copy of ``data`` whose last byte is the last readable one: an unreadable page follows it, so a
    kernel that reads past the array's end faults (the test's process dies) instead of reading junk."""
    page = mmap.PAGESIZE
    n_pages = -(-data.nbytes // page) + 1
    buf = mmap.mmap(-1, n_pages * page)
    guard = ctypes.addressof(ctypes.c_char.from_buffer(buf)) + (n_pages - 1) * page
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(guard), page, 0) == 0, ctypes.get_errno()  # PROT_NONE
    try:
        start = (n_pages - 1) * page - data.nbytes
        guarded = np.frombuffer(buf, np.uint8, data.nbytes, start).view(data.dtype).reshape(data.shape)
        guarded[...] = data
        yield guarded
        del guarded
    finally:
        libc.mprotect(ctypes.c_void_p(guard), page, mmap.PROT_READ | mmap.PROT_WRITE)


@pytest.mark.parametrize("bits", [5, 6, 7])
@pytest.mark.parametrize("hd", [8, 16, 24, 32, 40, 64, 256])
def test_the_kernels_staging_is_each_code_times_its_step_exactly(bits, hd):
    """The fused CPU kernel's staging of packed rows (kernels.stage: 16 codes per 16-byte load, the
    last pair of an even count of groups from a load ending at the row's end, a remaining group one
    64-bit load split into lanes, the scalar loop at head_dim 8; head_dim 16: no pair fits, 24 and 40:
    an odd count of groups) against numpy's packbits of every code in range (the most negative
    included), times the row's step f16(max_abs) * (1/qmax), bit for bit, for tiles that end at the
    store's last row, the store's bytes followed by an unreadable page (no load may pass the row's end)."""

    rng = np.random.default_rng(bits * hd)
    half, n = 2 ** (bits - 1), 40
    codes = rng.integers(-half, half, size=(1, n, hd))
    with before_a_guard_page(np.ascontiguousarray(numpy_pack(codes, bits))) as raw:  # [1, n, hd * bits / 8]
        _check_staging(raw, codes, bits, hd, rng)


def _check_staging(raw: np.ndarray, codes: np.ndarray, bits: int, hd: int, rng) -> None:
    from kvlens.kernels.stage import CODE_PACKED, _stage

    half, n = 2 ** (bits - 1), codes.shape[1]
    scale = (rng.random((1, n)) * 50 + 0.01).astype(np.float16)
    bsc = scale.view(np.uint16)[:, :, None]
    step = scale.astype(np.float32) * (np.float32(1.0) / np.float32(half - 1))
    for t0, nt in [(0, 32), (n - 32, 32), (n - 5, 5)]:
        tile = np.zeros((32, hd), np.float32)
        scratch = np.zeros(32 * max(hd // 32, 1) + 1, np.uint32)
        _stage(
            raw,
            CODE_PACKED + bits,
            bsc,
            0,
            t0,
            nt,
            tile.view(np.uint32),
            tile,
            scratch,
            scratch.view(np.float32),
        )
        want = codes[0, t0 : t0 + nt].astype(np.float32) * step[0, t0 : t0 + nt, None]
        np.testing.assert_array_equal(tile[:nt], want)


@pytest.mark.parametrize("kind", PACKED)
def test_store_reads_back_within_half_a_step(kind):
    k = StoreKind(kind)
    store = RowStore.empty(k, 2, 32, 128, CPU)
    rows = torch.randn(2, 20, 128, generator=torch.Generator().manual_seed(3)) * 5
    store.write(0, rows)
    assert store.head_dim == 128 and store.data.shape == (2, 32, 128 * k.bits // 8)
    assert store.scale.dtype == torch.float16
    step = store.scale[:, :20, None].float() / k.qmax  # the fp16 max_abs the codes were made with
    max_abs = rows.abs().amax(-1, keepdim=True)
    # half a step; the row's max may clip at qmax where fp16 rounded max_abs down (by <= 2^-11 of it)
    bound = torch.maximum(step / 2 * (1 + 1e-5), max_abs - k.qmax * step) + 1e-7
    assert ((store.read(0, 20) - rows).abs() <= bound).all()
    assert (store.scale[:, :20].float() - max_abs[..., 0]).abs().le(max_abs[..., 0] * 2.0**-11).all()


@pytest.mark.parametrize("device_path", ["cpu-jit", "torch"])
def test_a_row_beyond_the_fp16_range_is_refused_before_anything_is_stored(device_path):
    x = torch.randn(2, 3, 64)
    x[1, 2, 9] = -70000.0  # |max_abs| > 65504: no fp16 max_abs holds it
    if device_path == "torch":
        with pytest.raises(ValueError, match="overflows the fp16 max_abs of a row"):
            quantize_q8(x, bits=6, fp16_scale=True)
        return
    store = RowStore.empty(StoreKind.Q6H, 2, 8, 64, CPU)
    with pytest.raises(ValueError, match="overflows the fp16 max_abs of a row"):
        store.write(0, x)
    assert (store.data == 0).all() and (store.scale == 1).all()


def test_kind_properties():
    for kind, bits in (("q7h", 7), ("q6h", 6), ("q5h", 5)):
        k = StoreKind(kind)
        assert (k.bits, k.qmax, k.packed, k.rotated, k.row_scaled, k.int8, k.int4) == (
            bits, 2 ** (bits - 1) - 1, True, True, True, False, False,
        )  # fmt: skip
        assert k.dtype == torch.uint8 and k.row_width(64) == 8 * bits and k.ksum_bytes(64) == 0
    assert (StoreKind.Q8.bits, StoreKind.Q8.qmax, StoreKind.Q8.packed) == (8, 127, False)
    with pytest.raises(ValueError, match="power of two"):
        StoreKind.Q6H.check_head_dim(96)


def test_bytes_per_token_by_hand():
    """Layer 0 per KV head: (K q7h, V q5h), (K q8, V q6h); layer 1 q6h. head_dim 64:
    q7h 56+2, q5h 40+2, q8 64+4 + K code sums 2*2, q6h 48+2 bytes per row (fp16 max_abs, fp32 q8)."""
    q7, q5, q6, q8 = StoreKind.Q7H, StoreKind.Q5H, StoreKind.Q6H, StoreKind.Q8
    from kvlens.kv.recipe import head_recipe_mode

    mode = head_recipe_mode("r", [[(q7, q5), (q8, q6)], [(q6, q6), (q6, q6)]])
    expected = (58 + 42) + (72 + 50) + 2 * (50 + 50)
    assert mode.bytes_per_token(2, 2, 64) == expected == 422
    cache = KVCache(2, 2, 64, 32, mode)
    held = 0
    for store in (*cache.k, *cache.v):
        for part in getattr(store, "parts", [store]):
            held += sum(
                t.numel() * t.element_size() for t in (part.data, part.scale, part.ksum) if t is not None
            )
    assert cache.bytes_per_token() == expected and held == expected * 32
    assert MODES["q5h"].bytes_per_token(1, 1, 128) == 2 * (80 + 2)


def test_recipe_round_trip_with_the_packed_kinds(tmp_path, tiny):
    path = tmp_path / "r.json"
    path.write_text(
        json.dumps(
            {"kvlens_recipe": 1, "layers": [{"k": "q7h", "v": "q5h"}, {"k": ["q6h", "q8h"], "v": "q5h"}]}
        )
    )
    mode = load_recipe(path)
    assert mode.kinds(0) == (StoreKind.Q7H, StoreKind.Q5H)
    assert mode.head_kinds(1) == ((StoreKind.Q6H, StoreKind.Q5H), (StoreKind.Q8H, StoreKind.Q5H))
    save_recipe(mode, 2, tmp_path / "back.json")
    assert load_recipe(tmp_path / "back.json").heads == mode.heads
    llm = tiny.variant(kv=str(path), attn_backend="numba")
    text = llm.generate("the", max_new_tokens=3)
    assert isinstance(text, str)


@pytest.mark.parametrize("mode", ["q6h", "k=q8,v=q5h", "k=q7h,v=q8"])
def test_integer_backend_refuses_a_packed_kind_naming_it(tiny, mode):
    llm = tiny.variant(kv=mode, attn_backend="numba-int")
    kind = next(k for k in (KVMode.parse(mode).k, KVMode.parse(mode).v) if k.packed)
    with pytest.raises(BackendError, match=f"cannot read {kind} rows"):
        llm.generate("the", max_new_tokens=2)
    ks, vs = (RowStore.empty(k, 1, 32, 32, CPU, True) for k in (KVMode.parse(mode).k, KVMode.parse(mode).v))
    with pytest.raises(ValueError, match=f"cannot read {kind} rows"):
        decode_attention_int(torch.zeros(2, 32), ks, vs, 1)


def brute_force(sens, items, kinds, hd, budget):
    best = None
    for combo in itertools.product(kinds, repeat=len(items)):
        kld = sum(0.0 if k == StoreKind.F16 else sens[(*it, k)] for it, k in zip(items, combo, strict=True))
        size = sum(k.row_bytes(hd, with_ksum=it[-1] == "k") for it, k in zip(items, combo, strict=True))
        if kld <= budget and (best is None or size < best):
            best = size
    return best


@pytest.mark.parametrize("seed", range(4))
def test_plan_chooses_among_five_candidates(seed):
    """Sensitivities about 4x per bit below 8 (the uniform-code rule); the greedy choice stays within
    the budget, uses the intermediate widths, and lands near the enumerated optimum."""
    cfg = PlanConfig(model="m", corpus="c", kld_budget=1.0, candidates="q8h,q7h,q6h,q5h,q4h")
    kinds = cfg.candidates
    assert [k.bits for k in kinds] == [8, 7, 6, 5, 4]
    gen = torch.Generator().manual_seed(seed)
    items = [(layer, role) for layer in range(2) for role in ("k", "v")]
    sens = {}
    for it in items:
        a = float(torch.rand(1, generator=gen)) * 1e-4 * (4 if it[-1] == "k" else 1)
        for k in kinds:
            sens[(*it, k)] = a * 4.0 ** (8 - k.bits) * (0.8 + 0.4 * float(torch.rand(1, generator=gen)))
    budget = 1e-3
    chosen, predicted = choose(sens, 64, budget)
    assert predicted <= budget
    size = sum(k.row_bytes(64, with_ksum=it[-1] == "k") for it, k in chosen.items())
    assert size <= 1.25 * brute_force(sens, items, [StoreKind.F16, *kinds], 64, budget)

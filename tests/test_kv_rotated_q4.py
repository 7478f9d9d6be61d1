"""The rotated (q8h, q4h) and 4-bit (q4) KV kinds: the rotation, the 4-bit codes, every decode kernel
against a float64 reference, the engine end to end, and the ``k=...,v=...`` mode syntax.

References are independent of the code under test: the 4-bit rows are decoded here with numpy bit
operations, the Hadamard matrix is checked by its defining properties, and attention is the float64
softmax of :func:`kvlens.kernels.reference.reference_attention` over what the store holds.
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch
from tiny_models import write_hf

import kvlens
from kvlens.kernels import cpu
from kvlens.kernels.reference import reference_attention
from kvlens.kv.cache import KVCache, RowStore, rotations
from kvlens.kv.modes import MODES, KVMode, StoreKind, UnknownKVModeError
from kvlens.kv.quant import dequantize_q8, pack_q4, quantize_q4, rotation, unpack_q4
from kvlens.kv.schemes import SCHEMES

CPU = torch.device("cpu")
HAS_TRITON = importlib.util.find_spec("triton") is not None
NEW_KINDS = ["q8h", "q4", "q4h", "q7h", "q6h", "q5h"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny problems run on one thread


# ---------------------------------------------------------------- the rotation


@pytest.mark.parametrize("hd", [64, 128, 256])
def test_rotation_is_orthonormal_invertible_and_seeded(hd):
    r = rotation(hd, torch.float64)
    eye = torch.eye(hd, dtype=torch.float64)
    torch.testing.assert_close(r @ r.T, eye, rtol=0, atol=1e-13)
    torch.testing.assert_close(r.T @ r, eye, rtol=0, atol=1e-13)
    x = torch.randn(50, hd, dtype=torch.float64)
    torch.testing.assert_close((x @ r) @ r.T, x, rtol=0, atol=1e-12)
    # a randomized Hadamard matrix: every entry +-1/sqrt(d), and not the plain Sylvester one
    assert torch.allclose(r.abs(), torch.full_like(r, 1 / math.sqrt(hd)))
    assert (r[:, 0] < 0).any() and (r[:, 0] > 0).any()
    assert torch.equal(rotation(hd, torch.float64), r)  # fixed: one seed, the same matrix every call


def test_rotation_spreads_an_outlier_channel():
    x = torch.zeros(1, 128, dtype=torch.float64)
    x[0, 7] = 100.0
    y = x @ rotation(128, torch.float64)
    assert torch.allclose(y.abs(), torch.full_like(y, 100 / math.sqrt(128)))
    # the block rotation (q4h's, span 32) spreads it over its own block of 32 only
    y = (x @ rotation(128, torch.float64, span=32)).reshape(4, 32)
    assert torch.allclose(y[0].abs(), torch.full_like(y[0], 100 / math.sqrt(32))) and not y[1:].any()


def sylvester(n: int) -> np.ndarray:
    """The Sylvester Hadamard matrix of order n (a power of two), H_2n = [[H, H], [H, -H]], float64."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("span", [32, 64, None])
def test_block_rotation_is_the_signed_block_diagonal_hadamard(hd, span):
    """``rotation(d, span=b)`` is diag(s) (I_{d/b} ⊗ H_b) / sqrt(b) (numpy's Kronecker product of a
    numpy-built Sylvester matrix), orthonormal, with the same seeded signs as the whole-row rotation."""
    b = hd if span is None else span
    r = rotation(hd, torch.float64, span=span).numpy()
    signs = np.sign(rotation(hd, torch.float64).numpy()[:, 0])  # H's first column is all ones
    expected = signs[:, None] * np.kron(np.eye(hd // b), sylvester(b)) / math.sqrt(b)
    np.testing.assert_array_equal(r, expected)
    np.testing.assert_allclose(r @ r.T, np.eye(hd), rtol=0, atol=1e-13)


def test_which_kinds_rotate_by_blocks():
    """q4h (one fp16 scale per 32 values) rotates within each 32-value block; the row-scaled kinds
    rotate the whole row; the others not at all."""
    for hd in (64, 128, 256):
        assert StoreKind.Q4H.rotation_span(hd) == 32
        for kind in (StoreKind.Q8H, StoreKind.Q7H, StoreKind.Q6H, StoreKind.Q5H):
            assert kind.rotation_span(hd) == hd
        for kind in (StoreKind.Q8, StoreKind.Q4, StoreKind.F16, StoreKind.F32):
            assert kind.rotation_span(hd) == 0


@pytest.mark.parametrize("span", [0, 3, 48, 512])
def test_a_rotation_span_that_does_not_tile_the_row_is_refused(span):
    with pytest.raises(ValueError, match="span must be a power of two dividing head_dim 256"):
        rotation(256, span=span)


@pytest.mark.parametrize("hd", [64, 128, 256])
def test_scores_and_outputs_unchanged_by_rotation_without_quantization(hd):
    """(qR)(kR)^T = q k^T, and attention over vR rotated back by R^T is attention over v (float64)."""
    gen = torch.Generator().manual_seed(hd)
    q = torch.randn(8, 3, hd, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 40, hd, generator=gen, dtype=torch.float64) for _ in range(2))
    r = rotation(hd, torch.float64)
    pos = torch.arange(37, 40)
    out, w = reference_attention(q, k, v, pos, return_weights=True)
    out_r, w_r = reference_attention(q @ r, k @ r, v @ r, pos, return_weights=True)
    torch.testing.assert_close(w_r, w, rtol=0, atol=1e-13)
    torch.testing.assert_close(out_r @ r.T, out, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["q8h", "q4h"])
def test_rotated_kinds_refuse_a_head_dim_that_is_not_a_power_of_two(kind):
    with pytest.raises(ValueError, match="power of two"):
        KVCache(1, 1, 96, 32, KVMode.parse(kind))
    with pytest.raises(ValueError, match="divisible by 32"):
        KVCache(1, 1, 48, 32, KVMode.parse("q4"))


# ---------------------------------------------------------------- 4-bit codes


def test_pack_unpack_is_exact_for_every_code_pair():
    pairs = torch.tensor([[a, b] for a in range(-8, 8) for b in range(-8, 8)], dtype=torch.int8)  # [256, 2]
    # put each pair at (i, i + 16) of a block: the two codes that share a byte
    codes = torch.zeros(16, 32, dtype=torch.int8)
    codes[:, :16] = pairs[:, 0].reshape(16, 16)
    codes[:, 16:] = pairs[:, 1].reshape(16, 16)
    codes = codes.reshape(1, -1)  # 16 blocks, every (low, high) pair once
    packed = pack_q4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 256)
    assert torch.equal(unpack_q4(packed), codes)
    # the documented layout (llama.cpp q4_0): byte i of a block = element i (low) and i + 16 (high)
    raw = packed.numpy().astype(np.int32).reshape(16, 16)
    assert np.array_equal((raw & 15) - 8, pairs[:, 0].reshape(16, 16).numpy())
    assert np.array_equal((raw >> 4) - 8, pairs[:, 1].reshape(16, 16).numpy())
    with pytest.raises(ValueError, match="-8..7"):
        pack_q4(torch.full((1, 32), 8, dtype=torch.int8))


def q4_0_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's ``quantize_row_q4_0_ref`` transcribed from C, per block of 32, in numpy float32
    scalars: the stored codes (0..15, value ``(code - 8) * d``) and the fp16 scale bits."""
    blocks = np.asarray(x, np.float32).reshape(-1, 32)
    codes = np.empty(blocks.shape, np.int64)
    bits = np.empty(len(blocks), np.uint16)
    for i, blk in enumerate(blocks):
        amax = np.float32(0.0)
        vmax = np.float32(0.0)
        for v in blk:  # if (amax < fabsf(v)) { amax = fabsf(v); max = v; }
            if amax < abs(v):
                amax, vmax = abs(v), v
        d = np.float32(vmax / np.float32(-8.0))
        inv = np.float32(np.float32(1.0) / d) if d != 0 else np.float32(0.0)
        for j, v in enumerate(blk):
            y = np.float32(np.float32(v * inv) + np.float32(8.5))
            codes[i, j] = min(15, math.trunc(float(y)))  # (int8_t): truncation; MIN(15, ...)
        bits[i] = np.float16(d).view(np.uint16)
    return codes.reshape(np.shape(x)), bits.reshape(*np.shape(x)[:-1], -1)


def edge_blocks() -> torch.Tensor:
    """One row of 32-blocks, each an edge of the q4_0 rule."""
    blocks = torch.zeros(7, 32)
    blocks[0, :6] = torch.tensor([-3.0, 1.0, 3.0, -2.0, 0.75, -1.5])  # |max| tie, negative first: d = +3/8
    blocks[1, :6] = torch.tensor([3.0, 1.0, -3.0, -2.0, 0.75, -1.5])  # positive first: d = -3/8
    blocks[2, :5] = torch.tensor([8.0, -8.0, -7.5, 0.5, -0.5])  # d = -1: -8 clips to 15, x*id + 8.5 integers
    blocks[3, :4] = torch.tensor([-8.0, 8.0, 7.5, -0.5])  # d = +1: the mirror image
    # block 4 all zero; block 5 a scale that rounds to fp16 zero; block 6 random
    blocks[5, :3] = torch.tensor([1e-9, -2e-9, 5e-10])
    blocks[6] = torch.randn(32, generator=torch.Generator().manual_seed(5)) * 3
    return blocks.reshape(1, -1)


def test_q4_0_reference_by_hand():
    """The transcription itself, on values worked out from the C rule by hand."""
    codes, bits = q4_0_reference(edge_blocks().numpy())
    d = bits.view(np.float16).astype(np.float64).reshape(-1)
    assert d[:4].tolist() == [0.375, -0.375, -1.0, 1.0] and bits[0, 4] == 0x8000  # 0.0f / -8 = -0.0
    blk = codes.reshape(7, 32)
    # id = f32(8/3): -3 -> -8 + 8.5 -> 0; 1 -> 11.17 -> 11; 3 -> 16.5 clips to 15; 0.75 -> 10.5 -> 10
    assert blk[0, :6].tolist() == [0, 11, 15, 3, 10, 4]
    assert blk[1, :6].tolist() == [0, 5, 15, 13, 6, 12]  # the same block, max +3: d = -3/8
    assert blk[2, :5].tolist() == [0, 15, 15, 8, 9]  # 8 -> 0; -8 -> 16.5 clips to 15; 0.5 -> 8; -0.5 -> 9
    assert blk[3, :4].tolist() == [0, 15, 15, 8]  # -8 -> 0; 8 clips; 7.5 -> 16.0 clips; -0.5 -> 8
    assert (blk[4] == 8).all()  # an all-zero block: id = 0, every code 8 (value 0)


def test_q4_rule_is_llama_cpp_q4_0():
    """Codes and scale bits of kvlens' 4-bit rule (torch, the JIT store, the lab scheme) against the
    independent transcription; the one documented difference: a block whose fp16 scale is zero
    stores code 8 (C's codes there are multiplied by that zero; the values agree)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 20, 128, generator=gen) * torch.rand(3, 20, 1, generator=gen) * 5
    x[0, 0] = edge_blocks()[0, :128]
    x[0, 1] = edge_blocks()[0, 96:]  # blocks 3-6: all zero (4), a scale that rounds to fp16 zero (5)
    ref_codes, ref_bits = q4_0_reference(x.numpy())
    zero_scale = ref_bits.view(np.float16) == 0
    ref_codes = np.where(np.repeat(zero_scale, 32, -1), 8, ref_codes)
    assert zero_scale.sum() >= 2 and not zero_scale.all()
    codes, d16 = quantize_q4(x)
    assert np.array_equal(codes.numpy().astype(np.int64) + 8, ref_codes)
    assert np.array_equal(d16.view(torch.int16).numpy().view(np.uint16), ref_bits)
    store = RowStore.empty(StoreKind.Q4, 3, 32, 128, CPU)
    store.write(0, x)  # the CPU store: the JIT pass (kernels/q4store.py)
    raw = store.data[:, :20].numpy().astype(np.int64).reshape(3, 20, 4, 16)
    stored = np.concatenate((raw & 15, raw >> 4), axis=-1).reshape(3, 20, 128)
    assert np.array_equal(stored, ref_codes)
    assert np.array_equal(store.scale[:, :20].view(torch.int16).numpy().view(np.uint16), ref_bits)
    # the lab's q4 scheme is the same rule: identical values
    torch.testing.assert_close(store.read(0, 20), SCHEMES["q4"].fake_quant(x), rtol=0, atol=0)
    # |error| <= half a step, or up to a step where +8 clipped to +7; + the fp16 scale's rounding
    step = torch.from_numpy(np.abs(ref_bits.view(np.float16).astype(np.float32))).repeat_interleave(32, -1)
    d32 = (x.reshape(3, 20, 4, 32).abs().amax(-1) / 8).repeat_interleave(32, -1)
    bound = torch.maximum(step / 2, x.abs() - 7 * step) + 8 * (step - d32).abs() + 1e-7
    assert ((store.read(0, 20) - x).abs() <= bound).all()


@pytest.mark.parametrize("kind", [*NEW_KINDS, "q8", "f16"])
@pytest.mark.parametrize("hd", [64, 128, 256])
def test_bytes_per_token_are_the_stored_bytes(kind, hd):
    """row_bytes is what the store's tensors hold per (position, head), scales included."""
    k = StoreKind(kind)
    store = RowStore.empty(k, 2, 64, hd, CPU)
    held = store.data.numel() * store.data.element_size()
    if store.scale is not None:
        held += store.scale.numel() * store.scale.element_size()
    assert held == k.row_bytes(hd) * 2 * 64
    expected = {
        "q8h": hd + 4,
        "q8": hd + 4,
        "q4": hd // 2 + hd // 16,
        "q4h": hd // 2 + hd // 16,
        "q7h": hd * 7 // 8 + 2,  # one fp16 max_abs
        "q6h": hd * 6 // 8 + 2,  # one fp16 max_abs
        "q5h": hd * 5 // 8 + 2,  # one fp16 max_abs
        "f16": 2 * hd,
    }
    assert k.row_bytes(hd) == expected[kind]


# ---------------------------------------------------------------- kernels vs float64


def store_values(store: RowStore, length: int) -> torch.Tensor:
    """What attention must see, float64, decoded independently (4-bit: numpy nibbles and fp16 scales)."""
    if store.kind.int4:
        raw = store.data[:, :length].numpy().astype(np.int64)
        raw = raw.reshape(*raw.shape[:2], -1, 16)  # per block of 32: 16 bytes, low nibbles first
        codes = np.concatenate(((raw & 15) - 8, (raw >> 4) - 8), axis=-1).reshape(*raw.shape[:2], -1)
        scale = store.scale[:, :length].numpy().astype(np.float64).repeat(32, axis=-1)
        return torch.from_numpy(codes * scale)
    if store.kind.int8:
        return dequantize_q8(store.data[:, :length], store.scale[:, :length]).double()
    if store.kind.packed:  # numpy bits: code i is row bits [i*N, i*N+N), little-endian, two's complement
        n = store.kind.bits
        bits = np.unpackbits(store.data[:, :length].numpy(), axis=-1, bitorder="little").astype(np.int64)
        fields = bits.reshape(*bits.shape[:2], -1, n) @ (1 << np.arange(n))
        codes = np.where(fields >= 1 << (n - 1), fields - (1 << n), fields)
        step = store.scale[:, :length].numpy().astype(np.float64) / (2 ** (n - 1) - 1)
        return torch.from_numpy(codes * step[..., None])
    return store.data[:, :length].double()


def make_store(kind: str, n_kv: int, cap: int, hd: int, length: int, gen: torch.Generator) -> RowStore:
    """Rows [0, length) random, with per-row magnitudes and an outlier channel; loud garbage beyond."""
    store = RowStore.empty(StoreKind(kind), n_kv, cap, hd, CPU)
    rows = torch.randn(n_kv, length, hd, generator=gen) * torch.rand(n_kv, length, 1, generator=gen) * 4
    rows[..., 5] *= 8
    store.write(0, rows)
    if store.kind.int4:  # code -8 (nibble 0): q4_0 puts every block's max there, q4h's search some
        raw = store.data[:, :length].numpy().reshape(n_kv, length, hd // 32, 16)
        low = (((raw & 15) == 0) | ((raw >> 4) == 0)).any(-1)
        assert low.all() if store.kind == StoreKind.Q4 else low.any()
    if cap > length:  # would dominate (or overflow) the softmax if read
        store.data[:, length:] = 0xFF if store.kind.int4 or store.kind.packed else 127
        if store.scale is not None:
            store.scale[:, length:] = 6e4 if store.kind.int4 else 1e6  # packed 0xFF: code -1, * 1e6
    return store


def case(kind_k, kind_v, n_heads, n_kv, hd, length, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ks = make_store(kind_k, n_kv, length + 40, hd, length, gen)
    vs = make_store(kind_v, n_kv, length + 40, hd, length, gen)
    return torch.randn(n_heads, hd, generator=gen) * 2, ks, vs


def reference(q, ks, vs, length):
    return reference_attention(q.double()[:, None], store_values(ks, length), store_values(vs, length))[:, 0]


def assert_matches(out, ref, rtol=1e-5):
    # f32 accumulation of O(length) terms against float64: the kernels' own tolerance (test_kernels)
    out = torch.as_tensor(out).double()
    torch.testing.assert_close(out, ref, rtol=rtol, atol=rtol * float(ref.abs().max()))


KIND_PAIRS = [("q4", "q4"), ("q4h", "q4h"), ("q8h", "q8h"), ("q8h", "q4h"), ("q4", "f16"), ("f32", "q4")]
KIND_PAIRS += [("q7h", "q5h"), ("q6h", "q6h"), ("q5h", "f16"), ("q8", "q7h")]  # the packed kinds


@pytest.mark.parametrize("n_splits", [None, 3])
@pytest.mark.parametrize("length", [1, 33, 700])
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("kind_k,kind_v", KIND_PAIRS)
def test_numba_kernel_matches_float64(kind_k, kind_v, hd, length, n_splits):
    q, ks, vs = case(kind_k, kind_v, 6, 2, hd, length, seed=hd + length)
    assert_matches(cpu.decode_attention(q, ks, vs, length, n_splits=n_splits), reference(q, ks, vs, length))


def test_numba_kernel_paged_q4():
    """Through a block table (paged pool): logical block j read from physical block table[j]."""
    q, ks, vs = case("q4h", "q4", 8, 2, 128, 96 + 40, seed=9)
    perm = np.array([3, 0, 2, 1], np.int32)  # logical -> physical
    phys = torch.from_numpy(perm).repeat_interleave(32) * 32 + torch.arange(32).repeat(4)
    lk = RowStore(ks.kind, ks.data[:, phys[:100]].clone(), ks.scale[:, phys[:100]].clone())
    lv = RowStore(vs.kind, vs.data[:, phys[:100]].clone(), vs.scale[:, phys[:100]].clone())
    out = cpu.decode_attention(q, ks, vs, 100, table=perm, n_splits=2)
    assert_matches(out, reference(q, lk, lv, 100))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize(
    "kind_k,kind_v", [("q4", "q4"), ("q8h", "q4h"), ("q4h", "f16"), ("q7h", "q5h"), ("q6h", "q8")]
)
def test_triton_kernel_matches_float64(monkeypatch, kind_k, kind_v, hd):
    """Under TRITON_INTERPRET=1 on a machine without a GPU (conftest), like the other Triton tests."""
    from kvlens.kernels.gpu import decode_attention_triton

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, ks, vs = case(kind_k, kind_v, 8, 2, hd, 70, seed=hd)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on = [RowStore(s.kind, s.data.to(dev), None if s.scale is None else s.scale.to(dev)) for s in (ks, vs)]
    out = decode_attention_triton(q, *on, 70, n_splits=3, block_n=16)
    assert_matches(out.cpu(), reference(q, ks, vs, 70))


# ---------------------------------------------------------------- the cache and the engine


@pytest.mark.parametrize("mode", ["q8h", "q4h", "k=q8h,v=q4h"])
def test_rotated_cache_error_is_the_quantization_step(mode):
    """Read back and rotated by R^T, a row is within its quantization error (in the stored basis, where
    the steps are; the rotation preserves the 2-norm of the error)."""
    hd = 128
    m = KVMode.parse(mode)
    cache = KVCache(1, 2, hd, 64, m)
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(2, 50, hd, generator=gen) for _ in range(2))
    k[..., 3] += 30  # an outlier channel (what the rotation is for)
    cache.write(0, 0, k, v)
    rk, rv = rotations(cache.k[0], cache.v[0])
    assert rk is not None and (rv is not None) == m.v.rotated
    k_read, v_read = cache.read(0, 50)
    for x, got, kind in ((k, k_read, m.k), (v, v_read, m.v)):
        r = rotation(hd, torch.float64, span=kind.rotation_span(hd))
        xr = x.double() @ r
        amax = xr.abs().amax(-1, keepdim=True)
        if kind.int8:
            elem = (amax / 127 / 2).expand_as(xr)
        else:  # q4_0: half a step, or up to a step where +8 clipped to +7 (step |max| / 8); q4h: its
            # searched steps lose no more per block than q4_0 (test_kv_q4_search), so the same bound
            step = (xr.reshape(2, 50, -1, 32).abs().amax(-1) / 8).repeat_interleave(32, -1)
            elem = torch.maximum(step / 2, xr.abs() - 7 * step)
        err = ((got.double() @ r.T) - x.double()).norm(dim=-1)
        bound = (elem * 1.01 + 1e-6).norm(dim=-1)
        assert (err <= bound).all()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("beyond") / "hf"
    write_hf("qwen3", out, seed=11)  # head_dim 32: a power of two and one 4-bit block
    return kvlens.load(out, kv="f32", attn_backend="torch")


@pytest.mark.parametrize("mode", ["q8h", "q4", "q4h", "k=q8h,v=q4h", "q6h", "k=q7h,v=q5h"])
def test_engine_end_to_end_every_new_mode(tiny, mode):
    """Prefill then decode through the numba kernel and through torch over the same stored rows (like
    with like: equal to f32 rounding), and close to the f32 cache."""
    ids = torch.randint(5, 300, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    steps = {}
    for backend in ("torch", "numba"):
        llm = tiny.variant(kv=mode, attn_backend=backend)
        cache = llm.new_cache(len(ids) + 8)
        llm.forward(ids[:-4], cache, 0, prefill=True)
        steps[backend] = torch.cat(
            [
                llm.model.logits(llm.forward([t], cache, len(ids) - 4 + i, prefill=False))
                for i, t in enumerate(ids[-4:])
            ]
        )
        assert cache.bytes_per_token() == sum(
            (KVMode.parse(mode).k.row_bytes(32, with_ksum=True) + KVMode.parse(mode).v.row_bytes(32)) * 2
            for _ in range(2)
        )
    torch.testing.assert_close(
        steps["numba"], steps["torch"], rtol=1e-4, atol=1e-4 * float(steps["torch"].abs().max())
    )
    f32 = tiny.variant(kv="f32")
    ref = f32.logits(ids)[-4:]
    rel = float((steps["torch"] - ref).norm() / ref.norm())
    # the relative step is 1/254 of a row's absmax at 8 bits, 1/16 of a block's at 4: the logits move
    # by about that (measured 0.005 for q8h, 0.07-0.10 with a 4-bit kind, absmax/7 rule); a query or output left
    # unrotated, or a wrong layout, gives 0.7-0.9
    # (N-bit packed kinds: the step grows 2x per bit below 8, so 0.02 * 2^(8 - N))
    m = KVMode.parse(mode)
    assert rel < (0.25 if m.k.int4 or m.v.int4 else 0.02 * 2 ** (8 - min(m.k.bits, m.v.bits))), rel
    text = tiny.variant(kv=mode, attn_backend="numba").generate("the", max_new_tokens=4)
    assert isinstance(text, str)


# ---------------------------------------------------------------- the mode syntax


def test_split_mode_parse():
    m = KVMode.parse("k=q8h,v=q4h")
    assert (m.k, m.v, m.name) == (StoreKind.Q8H, StoreKind.Q4H, "k=q8h,v=q4h")
    assert KVMode.parse("k=q4h, v=q4h") is MODES["q4h"]  # a split naming a registered mode is that mode
    assert KVMode.parse("k=q8,v=f32") is MODES["q8-k"]
    for bad, match in [
        ("k=q3,v=q8", "unknown K kind 'q3'"),
        ("k=q8,v=int4", "unknown V kind 'int4'"),
        ("k=q8", "k=KIND,v=KIND"),
        ("k=q8,k=q8", "k=KIND,v=KIND"),
        ("k=q8,v=q8,v=q4", "k=KIND,v=KIND"),
        ("q5", "unknown KV cache mode"),
    ]:
        with pytest.raises(UnknownKVModeError, match=match):
            KVMode.parse(bad)

"""The JIT cache writes of the rotated and 4-bit kinds (kernels/q4store.py) against the torch
references they replace: bit-identical rotation (fast Walsh–Hadamard), bit-identical 4-bit codes and
fp16 scales (kv.quant.quantize_q4 / pack_q4, themselves checked against a numpy transcription of
llama.cpp's q4_0 in test_kv_rotated_q4.py), near-tie values, all-zero rows, fp16-subnormal and
zero scales included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlens.kernels.bits import fp16_bits
from kvlens.kv.cache import KVCache
from kvlens.kv.modes import KVMode
from kvlens.kv.quant import (
    pack_q4,
    quantize_q4,
    rotate_rows,
    rotate_rows_torch,
    rotation,
    store_q4,
    unrotate_rows,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def awkward_rows(n_kv: int, n: int, hd: int, seed: int) -> torch.Tensor:
    """Random rows of mixed magnitudes, plus rows built to hit the rule's edge cases."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_kv, n, hd, generator=gen) * torch.rand(n_kv, n, 1, generator=gen).pow(3) * 40
    x[0, 0] = 0.0  # an all-zero row
    x[0, 1, :32] = 1e-9  # a block whose scale rounds to fp16 zero
    x[0, 2] *= 1e-5  # fp16-subnormal scales
    x[0, 4, :32] = -2e-38  # a block whose 1/d overflows f32 (d = 2.5e-39)
    # exact ties of x * id + 8.5 (q4_0): the block's max -8 -> d = 1, so x * id = x exactly
    ties = torch.tensor([-8.0, 8.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 6.5, -6.5, 7.5, -7.5])
    x[0, 3, : ties.numel()] = ties
    x[0, 3, ties.numel() : 32] = 0.25
    x[0, 5, :32] = -x[0, 3, :32]  # the mirror block: max +8, d = -1
    # one ulp either side of a tie, at a scale where 1/d is inexact: each block's max is -8 d, so
    # d is the block's scale and x * id lands next to k + 0.5
    d = torch.rand(n_kv, 8, hd // 32, 1, generator=gen) * 3 + 0.1
    k = torch.randint(-8, 7, (n_kv, 8, hd // 32, 32), generator=gen).float() + 0.5
    k[..., 0] = -8.0
    y = (k * d).reshape(n_kv, 8, hd)
    y[..., 1::3] = torch.nextafter(y[..., 1::3], torch.tensor(np.inf))
    y[..., 2::3] = torch.nextafter(y[..., 2::3], torch.tensor(-np.inf))
    x[:, 6:14] = y
    return x


@pytest.mark.parametrize("span", [None, 32])
@pytest.mark.parametrize("hd", [32, 64, 128, 256])
def test_jit_rotation_is_bit_identical_to_torch_and_is_the_rotation(hd, span):
    x = awkward_rows(2, 40, hd, seed=hd)
    jit = rotate_rows(x, span)
    assert torch.equal(jit, rotate_rows_torch(x, span))
    # and it is x @ R (float64): f32 rounding of log2(d) butterfly levels, with headroom
    r = rotation(hd, torch.float64, span=span)
    # f32 rounding of log2(d) butterfly levels over partial sums <= sqrt(d) |x|max, with headroom
    tol = 4 * np.log2(hd) * 2**-24 * x.abs().amax(-1, keepdim=True).double() * np.sqrt(hd) + 1e-30
    assert ((jit.double() - x.double() @ r).abs() <= tol).all()
    # the inverse (attention's output over rotated V): y @ R.T, and back to x
    back = unrotate_rows(jit, span)
    assert ((back.double() - jit.double() @ r.T).abs() <= tol).all()
    assert ((back.double() - x.double()).abs() <= 2 * tol).all()


def test_fp16_bits_round_to_nearest_even_like_numpy():
    gen = np.random.default_rng(0)
    f16 = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)  # every finite f16 >= 0
    mids = (f16[:-1].astype(np.float64) + f16[1:]) / 2  # exact ties, f32-representable
    vals = np.concatenate(
        (
            f16,
            mids.astype(np.float32),
            np.nextafter(mids.astype(np.float32), np.float32(0)),
            np.nextafter(mids.astype(np.float32), np.float32(np.inf)),
            (gen.random(20000) * 65504).astype(np.float32),
            np.float32(2.0) ** gen.uniform(-30, -10, 20000).astype(np.float32),
        )
    )
    vals = vals[vals <= 65504]
    vals = np.concatenate((vals, -vals, [np.float32(-0.0)]))  # q4_0's scale is signed (d = max / -8)
    got = np.array([fp16_bits(v) for v in vals], np.uint16)
    assert np.array_equal(got, vals.astype(np.float16).view(np.uint16))


@pytest.mark.parametrize("hd", [32, 64, 256])
def test_jit_q4_store_is_bit_identical_to_the_reference_quantizer(hd):
    x = awkward_rows(3, 30, hd, seed=7 + hd)
    for rows in (x, rotate_rows(x)):
        data = torch.zeros(3, 40, hd // 2, dtype=torch.uint8)
        scale = torch.ones(3, 40, hd // 32, dtype=torch.float16)
        store_q4(rows, data, scale, 5)
        codes, d16 = quantize_q4(rows)
        assert torch.equal(data[:, 5:35], pack_q4(codes))
        assert torch.equal(scale[:, 5:35].view(torch.int16), d16.view(torch.int16))
        assert (data[:, :5] == 0).all() and (data[:, 35:] == 0).all()  # nothing outside the rows


def test_jit_q4_store_refuses_a_scale_beyond_fp16():
    """d = |max| / 8: 8 x 65504 is the largest |x| stored (d = -65504 exactly); the next f32 up is refused."""
    rows = torch.zeros(1, 2, 64)
    rows[0, 1, 40] = 8 * 65504
    data, scale = torch.zeros(1, 4, 32, dtype=torch.uint8), torch.ones(1, 4, 2, dtype=torch.float16)
    store_q4(rows, data, scale, 0)
    assert float(scale[0, 1, 1]) == -65504.0 and int(data[0, 1, 16 + 8]) == 0x80  # element 40: code 0, 56: 8
    assert torch.equal(quantize_q4(rows)[1], scale[:, :2])
    rows[0, 1, 40] = torch.nextafter(torch.tensor(8 * 65504.0), torch.tensor(np.inf))
    data.zero_()
    with pytest.raises(ValueError, match="overflows the fp16 scale"):
        store_q4(rows, data, scale, 0)
    with pytest.raises(ValueError, match="overflows the fp16 scale"):
        quantize_q4(rows)  # the reference refuses the same rows
    assert (data == 0).all()  # refused before anything was written


@pytest.mark.parametrize("mode", ["q8h", "q4h", "q4", "k=q8h,v=q4h"])
def test_cache_write_stores_the_reference_rules_bits(mode):
    """The cache's CPU write (JIT rotation + JIT store) holds exactly what the torch reference ops
    (torch FWHT, quantize_q8 / quantize_q4 + pack_q4) give."""
    from kvlens.kv.quant import quantize_q8

    m = KVMode.parse(mode)
    cache = KVCache(1, 2, 64, 64, m)
    k, v = awkward_rows(2, 20, 64, seed=1), awkward_rows(2, 20, 64, seed=2)
    cache.write(0, 3, k, v)
    for rows, store in ((k, cache.k[0]), (v, cache.v[0])):
        span = store.kind.rotation_span(64)
        basis = rotate_rows_torch(rows, span) if span else rows
        if store.kind.int4:
            codes, d16 = quantize_q4(basis, search=store.kind.scale_search)
            assert torch.equal(store.data[:, 3:23], pack_q4(codes))
            assert torch.equal(store.scale[:, 3:23], d16)
        else:
            q, max_abs = quantize_q8(basis)
            assert torch.equal(store.data[:, 3:23], q)
            assert torch.equal(store.scale[:, 3:23], max_abs)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU here (scripts/gpu-check runs it on one)"
)
@pytest.mark.parametrize("mode", ["f16", "bf16", "q8", "q8h", "q4", "q4h", "q6h", "q5h", "k=q8h,v=q4h"])
def test_cache_written_on_cuda_holds_the_cpu_bytes(mode):
    """The GPU's write (the torch ops) and the CPU's (the JIT passes) store the same bytes: a cache,
    a prefix block or a disk-tier file means the same on either device."""
    m = KVMode.parse(mode)
    k, v = awkward_rows(2, 20, 64, seed=1), awkward_rows(2, 20, 64, seed=2)
    caches = []
    for dev in (torch.device("cpu"), torch.device("cuda")):
        cache = KVCache(1, 2, 64, 64, m, dev)
        cache.write(0, 3, k.to(dev), v.to(dev))
        caches.append(cache)
    cpu, gpu = caches
    for a, b in ((cpu.k[0], gpu.k[0]), (cpu.v[0], gpu.v[0])):
        assert torch.equal(a.data, b.data.cpu()), (mode, int((a.data != b.data.cpu()).sum()))
        if a.kind.quantized:
            assert torch.equal(a.scale, b.scale.cpu()), (mode, int((a.scale != b.scale.cpu()).sum()))

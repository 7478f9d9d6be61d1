"""The edges of the KV quantizers, by hand, in both implementations where there are two (the torch
rule and the CPU JIT store): the seed's tiny-row floor at exactly 1e-6, the fp16 scale's last finite
value, the 32-block code sums the integer kernels read, and llama.cpp's block rules where a scale
overflows or underflows fp16 or a block is all zeros."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvlens.kv.kinds import StoreKind
from kvlens.kv.nbit import store_packed, unpack_bits
from kvlens.kv.quant import (
    block_sums,
    quantize_q4,
    quantize_q8,
    quantize_sym_blocks,
    store_q4,
    store_q8,
)
from kvlens.kv.schemes import SCHEMES
from kvlens.kv.stores import RowStore

TINY = float(np.float32(1e-6))  # the floor as float32 compares it
FP16_MAX = 65504.0


def jit_q8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows [n_kv, n, d]`` through the CPU store: (codes, max_abs, 32-block code sums)."""
    n_kv, n, d = rows.shape
    data = torch.zeros(n_kv, n, d, dtype=torch.int8)
    scale = torch.zeros(n_kv, n)
    ksum = torch.zeros(n_kv, n, d // 32, dtype=torch.int16)
    store_q8(rows, data, scale, 0, ksum)
    return data, scale, ksum


def test_a_row_at_exactly_the_floor_keeps_its_own_scale():
    """max |x| == 1e-6 (float32) is not under the floor: codes ±127 at scale 1e-6. One float32 step
    below it, the row takes scale 1.0 and its codes are 0 (torch rule and JIT store alike)."""
    at = torch.full((1, 1, 32), TINY)
    at[0, 0, 1::2] = -TINY
    below = at * float(np.nextafter(np.float32(1.0), np.float32(0.0)))  # 1 - 2^-24: one step down
    assert float(below.abs().max()) < TINY
    for codes, scale in (quantize_q8(at), jit_q8(at)[:2]):
        assert float(scale.flatten()[0]) == TINY
        assert codes.flatten().tolist() == [127, -127] * 16
    for codes, scale in (quantize_q8(below), jit_q8(below)[:2]):
        assert float(scale.flatten()[0]) == 1.0 and not codes.any()


@pytest.mark.parametrize("bits", [7, 6, 5])
def test_the_fp16_scale_holds_its_last_finite_value(bits):
    """A packed row whose max |x| is 65504, fp16's largest finite value, is stored; one float32 step
    above it is refused, by the torch rule and the JIT store, which then stores nothing."""
    qmax = 2 ** (bits - 1) - 1
    top = torch.zeros(1, 1, 8)
    top[0, 0, 0], top[0, 0, 1] = FP16_MAX, -FP16_MAX / 2
    q, max_abs = quantize_q8(top, bits=bits, fp16_scale=True)
    assert float(max_abs.flatten()[0]) == FP16_MAX and q.flatten()[:2].tolist() == [qmax, -(qmax // 2)]
    data = torch.zeros(1, 1, bits, dtype=torch.uint8)
    scale = torch.zeros(1, 1, dtype=torch.float16)
    store_packed(top, data, scale, 0, bits)
    assert float(scale[0, 0]) == FP16_MAX
    over = top.clone()
    over[0, 0, 0] = float(np.nextafter(np.float32(FP16_MAX), np.float32(np.inf)))
    with pytest.raises(ValueError, match="overflows the fp16 max_abs of a row"):
        quantize_q8(over, bits=bits, fp16_scale=True)
    data2, scale2 = torch.zeros(1, 2, bits, dtype=torch.uint8), torch.zeros(1, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match="overflows the fp16 max_abs of a row"):
        store_packed(torch.cat([top, over], dim=1), data2, scale2, 0, bits)
    assert not data2.any() and not scale2.any()  # the good row before it is not stored either


def test_a_first_row_past_fp16_is_refused_by_the_jit_store():
    """The JIT store reports the first bad row by its flat index, 0 included."""
    rows = torch.ones(2, 3, 8)
    rows[0, 0, 3] = 1e6
    with pytest.raises(ValueError, match="1e\\+06 overflows the fp16 max_abs of a row"):
        store_packed(
            rows, torch.zeros(2, 3, 6, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.float16), 0, 6
        )


def test_block_sums_are_the_codes_per_32_block():
    """Codes 0..63 and -64..-1 of a 64-wide row (two 32-blocks), written out: sums 496 and -1552;
    the JIT store's sums over real rows equal the sums of its own codes, block by block."""
    q = torch.cat([torch.arange(64), torch.arange(-64, 0)]).to(torch.int8).reshape(2, 64)
    assert block_sums(q).tolist() == [[496, 1520], [-1552, -528]]
    assert block_sums(q).dtype == torch.int16
    rows = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3)) * 4
    codes, _, ksum = jit_q8(rows)
    by_hand = [
        [[int(codes[h, j, 32 * b : 32 * b + 32].sum()) for b in range(2)] for j in range(5)] for h in range(2)
    ]
    assert ksum.tolist() == by_hand


def test_a_block_scale_past_fp16_is_refused():
    """q8_0's d = absmax / 127: absmax 127 * 65504 has d = 65504 (stored); twice that is refused."""
    ok = torch.zeros(1, 32)
    ok[0, 0] = 127.0 * FP16_MAX
    q, d16 = quantize_sym_blocks(ok, 127.0)
    assert float(d16[0]) == FP16_MAX and int(q[0, 0]) == 127
    with pytest.raises(ValueError, match="overflows the fp16 scale of a block"):
        quantize_sym_blocks(ok * 2, 127.0)
    with pytest.raises(ValueError, match="q8_0: .*overflows the fp16 scale of a block"):
        SCHEMES["q8_0"].quantize((ok * 2).reshape(1, 1, 32))


def test_a_block_scale_that_underflows_fp16_gets_zero_codes():
    """absmax 1e-9: d = 7.9e-12 rounds to an fp16 zero, so the codes (127 by the f32 rule) would
    decode to 0 anyway: they are stored as 0, with a zero scale."""
    x = torch.zeros(1, 32)
    x[0, :3] = torch.tensor([1e-9, -5e-10, 2.5e-10])
    q, d16 = quantize_sym_blocks(x, 127.0)
    assert float(d16[0]) == 0.0 and not q.any()
    assert torch.equal(SCHEMES["q8_0"].fake_quant(x.reshape(1, 1, 32)), torch.zeros(1, 1, 32))


def test_an_all_zero_block_has_llama_cpp_s_negative_zero_scale():
    """llama.cpp's q4_0 starts its max from +0.0f, so an all-zero block has d = 0.0f / -8 = -0.0f
    (fp16 bits 0x8000), whether its zeros are +0 or -0; the torch rule and the JIT store agree."""
    for zero in (0.0, -0.0):
        x = torch.full((1, 1, 32), zero)
        codes, d16 = quantize_q4(x)
        assert not codes.any() and d16.view(torch.int16).item() == -(2**15)
        assert math.copysign(1.0, float(d16.flatten()[0])) == -1.0
        data = torch.zeros(1, 1, 16, dtype=torch.uint8)
        scale = torch.zeros(1, 1, 1, dtype=torch.float16)
        store_q4(x, data, scale, 0)
        assert scale.view(torch.int16).item() == -(2**15) and torch.equal(data, torch.full_like(data, 0x88))


# a block where two of q4h's candidates have equal gains and different codes (found by
# docs/testing/planted-kvquant29/q4h_ties.py): C keeps the first (its strict ``>``)
EQUAL_GAINS = [0.0, -0.5, 7.0, 7.0, 1.0, 1.0, 1.0, 7.0, 7.0, 7.0, 1.0, -2.5, -7.0, 1.0, 8.0, 0.0,
               1.0, 1.0, 1.0, 2.0, -7.0, -1.0, 7.0, 2.5, -7.0, 7.0, 1.0, 0.0, 0.0, 7.0, -7.0, 1.0]  # fmt: skip


def test_q4h_ties_and_its_smallest_block_against_the_reference():
    """Blocks of exact .5 ties at the first candidate's scale (C's nearest rounds them to even; a
    neighbouring candidate reaches the other rounding's codes, so no block tried here or in 17,000
    random ones tells the two roundings apart), a block where two candidates' gains are equal (the
    first wins), and a block whose |max| is exactly make_qx_quants' 1e-15f (searched, not zeroed: its step rounds to an fp16 -0, bits 0x8000, where a zeroed block
    stores +0): the torch rule and the JIT store against ``test_kv_q4_search``'s transcription."""
    from test_kv_q4_search import searched_reference

    x = torch.zeros(1, 4, 64)
    x[0, 0, :32] = torch.tensor([-8.0, 2.5, 1.5, -0.5, 3.5, -6.5, 4.5, 0.5] * 4)  # iscale 1: ties
    x[0, 0, 32:] = torch.tensor([8.0, -2.5, -1.5, 0.5, -3.5, 6.5, -4.5, 5.5] * 4)
    x[0, 1, :32] = torch.arange(-16, 16) + 0.5  # every value a tie at iscale -8/15.5 ... and more
    x[0, 1, 32:] = torch.tensor(EQUAL_GAINS)  # candidates with equal gains: the first one wins
    x[0, 2, :32] = float(np.float32(1e-15))
    x[0, 3, :32] = float(np.float32(1e-15)) * 0.5  # under it: zeroed
    ref_codes, ref_bits = searched_reference(x.numpy())
    assert ref_bits[0, 2, 0] == 0x8000 and ref_bits[0, 3, 0] == 0
    codes, d16 = quantize_q4(x, search=True)
    assert np.array_equal(codes.numpy().astype(np.int64) + 8, ref_codes)
    assert np.array_equal(d16.view(torch.int16).numpy().view(np.uint16), ref_bits)
    data, scale = torch.zeros(1, 4, 32, dtype=torch.uint8), torch.zeros(1, 4, 2, dtype=torch.float16)
    store_q4(x, data, scale, 0, search=True)
    assert np.array_equal(scale.view(torch.int16).numpy().view(np.uint16), ref_bits)


def test_q4_refuses_a_row_width_that_is_not_whole_blocks():
    for width in (48, 16, 33):
        rows = torch.ones(1, 1, width)
        with pytest.raises(ValueError, match=f"q4 needs a last dimension divisible by 32, got {width}"):
            quantize_q4(rows)
        data, scale = torch.zeros(1, 1, 64, dtype=torch.uint8), torch.zeros(1, 1, 4, dtype=torch.float16)
        with pytest.raises(ValueError, match="divisible by 32"):
            store_q4(rows, data, scale, 0)


def test_a_group_cut_short_is_scaled_by_its_own_values():
    """KIVI-2 values (groups of 32 channels) of a 40-wide row: the last group holds channels 32..39
    only. Their values 10..17 give min 10 and scale (17 - 10) / 3; 10 and 17 are stored exactly."""
    x = torch.zeros(1, 1, 40)
    x[0, 0, :32] = torch.linspace(-1.0, 1.0, 32)
    x[0, 0, 32:] = torch.arange(10.0, 18.0)
    kivi = SCHEMES["kivi"]
    qt = kivi.quantize(x, "v")
    assert qt.zero.flatten().tolist() == [-1.0, 10.0]
    assert qt.scale.flatten()[1].item() == pytest.approx(7.0 / 3.0, rel=1e-7)
    y = kivi.fake_quant(x, "v")
    assert y[0, 0, 32].item() == 10.0 and y[0, 0, 39].item() == pytest.approx(17.0, rel=1e-7)
    assert (kivi.step(x, "v")[0, 0, 32:] == qt.scale.flatten()[1]).all()


def test_fp8_steps_by_hand_down_to_the_subnormals():
    """A row whose max is 448 has scale 1: e4m3's spacing is 2^(e-3) in the binade [2^e, 2^(e+1)),
    and 2^-9 below 2^-6 (the subnormals share the smallest normal binade's spacing)."""
    x = torch.zeros(1, 1, 8)
    x[0, 0, :6] = torch.tensor([448.0, 1.0, 2.0**-6, 2.0**-7, 2.0**-10, 3.0])
    step = SCHEMES["fp8"].step(x)
    assert SCHEMES["fp8"].quantize(x).scale.flatten().tolist() == [1.0]
    assert step.flatten()[:6].tolist() == [32.0, 0.125, 2.0**-9, 2.0**-9, 2.0**-9, 0.25]


@pytest.mark.parametrize(("name", "levels"), [("kivi", 3), ("kivi4", 15)])
def test_kivi_codes_use_exactly_2_to_the_bits_levels(name, levels):
    """A V group 0, 1, ..., levels (and the rest at 0) has scale 1: codes 0..levels, all exact."""
    x = torch.zeros(1, 1, 32)
    x[0, 0, : levels + 1] = torch.arange(levels + 1.0)
    qt = SCHEMES[name].quantize(x, "v")
    assert qt.scale.flatten().tolist() == [1.0] and int(qt.codes.max()) == levels
    assert torch.equal(SCHEMES[name].fake_quant(x, "v"), x)


def test_a_packed_row_of_the_wrong_length_and_a_misshapen_center_are_refused():
    with pytest.raises(ValueError, match="a packed row of 7-bit codes is a multiple of 7 bytes, got 10"):
        unpack_bits(torch.zeros(2, 10, dtype=torch.uint8), 7)
    cpu = torch.device("cpu")
    RowStore.empty(StoreKind.Q8, 2, 4, 64, cpu, center=torch.zeros(2, 1, 64))  # the shape it takes
    for shape in ((2, 64), (1, 1, 64), (2, 1, 32), (2, 4, 64)):
        with pytest.raises(ValueError, match=r"a store's K centers are \[2, 1, 64\], got"):
            RowStore.empty(StoreKind.Q8, 2, 4, 64, cpu, center=torch.zeros(shape))

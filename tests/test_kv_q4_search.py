"""q4h's 4-bit step search (llama.cpp's ``make_qx_quants`` with weights 1): the torch rule and the JIT
store against an independent numpy transcription, the error it removes, its fp16 range refusal, and
the cache writing it for q4h only.

The reference is written from the rule's statement (C's loop structure, numpy float32 scalars for
the candidate steps and codes, Python floats for the sums), not from kvlens' code.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlens.kv.cache import RowStore
from kvlens.kv.modes import StoreKind
from kvlens.kv.quant import dequantize_q4, quantize_q4, store_q4, unpack_q4

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny problems run on one thread


def searched_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants(32, nmax=8, x, L, ·, weights 1) per block of 32: stored codes 0..15 and fp16
    step bits. Candidates ``is`` = 0, -9..-1, 1..9: ``iscale = -(8 + 0.1f*is) / max`` (f32),
    ``l = clamp(nearest(iscale*x), -8, 7)``, the step ``sum(l x) / sum(l^2)``; the first candidate with
    the largest ``sum(l x)^2 / sum(l^2)`` wins. |max| < 1e-15f: all zero. A step that rounds to an
    fp16 zero stores code 8 (value 0)."""
    blocks = np.asarray(x, np.float32).reshape(-1, 32)
    codes = np.empty(blocks.shape, np.int64)
    bits = np.empty(len(blocks), np.uint16)
    for b, blk in enumerate(blocks):
        amax, vmax = np.float32(0.0), np.float32(0.0)
        for v in blk:
            if amax < abs(v):
                amax, vmax = abs(v), v
        if amax < np.float32(1e-15):
            codes[b], bits[b] = 8, 0
            continue
        best, step, chosen = -1.0, 0.0, None
        for i in [0, *range(-9, 0), *range(1, 10)]:
            iscale = np.float32(-(np.float32(8.0) + np.float32(0.1) * np.float32(i)) / vmax)
            ls = [int(min(7, max(-8, np.rint(np.float32(iscale * v))))) for v in blk]
            sumlx = sum(lv * float(v) for lv, v in zip(ls, blk, strict=True))
            suml2 = float(sum(lv * lv for lv in ls))
            if sumlx * sumlx / suml2 > best:
                best, step, chosen = sumlx * sumlx / suml2, sumlx / suml2, ls
        d16 = np.float16(np.float32(step))
        bits[b] = d16.view(np.uint16)
        codes[b] = 8 if d16 == 0 else np.array(chosen) + 8
    return codes.reshape(np.shape(x)), bits.reshape(*np.shape(x)[:-1], -1)


def test_reference_by_hand():
    """Two blocks worked out by hand (the other 30 values zero).

    [7, 5]: is = 0 gives iscale -8/7, codes (-8, -6) (5 * 8/7 = 5.71), gain 86²/100 = 73.96; is = -9
    gives -7.1/7, codes (-7, -5) (5 * 7.1/7 = 5.07), step -74/74 = -1 exactly, gain 74 = sum x²
    (no error): it wins. q4_0 would store d = -7/8 and 5 as -6 * d = 5.25.
    [3, 1]: is = 0 gives codes (-8, -3), gain 27²/73 = 9.986; is = -9..-6 give (-7, -2), 23²/53 =
    9.981; is = -5 (7.5/3 = 2.5 exactly, to even) (-8, -2), 26²/68 = 9.94; the rest tie with is = 0,
    which comes first: step -27/73."""
    blk = np.zeros((2, 32), np.float32)
    blk[0, :2] = [7.0, 5.0]
    blk[1, :2] = [3.0, 1.0]
    codes, bits = searched_reference(blk)
    assert codes[0, :2].tolist() == [1, 3] and float(bits.view(np.float16)[0, 0]) == -1.0
    assert codes[1, :2].tolist() == [0, 5]
    assert bits[1, 0] == np.float16(np.float32(-27 / 73)).view(np.uint16)
    assert (codes[:, 2:] == 8).all()  # zeros stay zero


def rows_to_search(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 24, 128, generator=gen) * torch.rand(3, 24, 1, generator=gen).pow(3) * 30
    x[0, 0] = 0.0  # all zero
    x[0, 1, :32] = 1e-9  # a step that rounds to fp16 zero
    x[0, 1, 32:64] = 3e-16  # under 1e-15: all zero without a 1/max
    x[0, 2] *= 1e-5  # fp16-subnormal steps
    x[0, 3, :32] = torch.tensor([-4.0, 4.0] * 16)  # a |max| tie: the first (negative) is max
    x[0, 4, :32] = torch.arange(32) / 4.0 - 4.0  # a ramp: candidates give equal codes, ties in gain
    x[0, 5, :32] = 1.0  # a constant block
    x[1, 0] = torch.randn(128, generator=gen).sign() * torch.randn(128, generator=gen).abs().pow(
        4
    )  # heavy tails
    return x


@pytest.mark.parametrize("seed", [0, 1])
def test_torch_and_jit_rules_equal_the_reference(seed):
    x = rows_to_search(seed)
    ref_codes, ref_bits = searched_reference(x.numpy())
    codes, d16 = quantize_q4(x, search=True)
    assert np.array_equal(codes.numpy().astype(np.int64) + 8, ref_codes)
    assert np.array_equal(d16.view(torch.int16).numpy().view(np.uint16), ref_bits)
    data = torch.zeros(3, 30, 64, dtype=torch.uint8)
    scale = torch.ones(3, 30, 4, dtype=torch.float16)
    store_q4(x, data, scale, 2, search=True)  # the CPU store: the JIT pass
    assert np.array_equal(unpack_q4(data[:, 2:26]).numpy().astype(np.int64) + 8, ref_codes)
    assert np.array_equal(scale[:, 2:26].view(torch.int16).numpy().view(np.uint16), ref_bits)
    assert (data[:, :2] == 0).all() and (data[:, 26:] == 0).all()


def block_errors(x: torch.Tensor, search: bool) -> torch.Tensor:
    codes, d16 = quantize_q4(x, search=search)
    blocks = codes.float().reshape(*x.shape[:-1], -1, 32) * d16.float().unsqueeze(-1)
    return (blocks - x.reshape(blocks.shape)).pow(2).sum(-1)


def test_the_search_never_loses_to_q4_0():
    """Its first candidate has q4_0's codes (but for exact .5 ties) and the least-squares step for
    them, so per block its error is at most q4_0's, up to the fp16 rounding of the steps (2^-11
    relative on each step)."""
    x = torch.randn(4000, 64, generator=torch.Generator().manual_seed(9)) * torch.rand(4000, 1).add(0.1)
    searched, plain = block_errors(x, True), block_errors(x, False)
    assert (searched <= plain * (1 + 4e-3)).all()
    assert searched.sum() < plain.sum()


def test_a_searched_step_beyond_fp16_is_refused_and_nothing_stored():
    """The block [7s, 5s] has the searched step -s (the by-hand block above); with s = 70,000 that is
    past fp16 (65504) while q4_0's step, 7s/8 = 61,250, is in range: q4h refuses what q4 stores."""
    rows = torch.zeros(1, 2, 64)
    rows[0, 1, 40:42] = torch.tensor([7.0, 5.0]) * 70000
    quantize_q4(rows)  # q4_0: in range
    data, scale = torch.zeros(1, 4, 32, dtype=torch.uint8), torch.zeros(1, 4, 2, dtype=torch.float16)
    for refuse in (
        lambda: quantize_q4(rows, search=True),
        lambda: store_q4(rows, data, scale, 0, search=True),
    ):
        with pytest.raises(ValueError, match="overflows the fp16 searched scale"):
            refuse()
    assert (data == 0).all() and (scale == 0).all()
    rows[0, 1, 40:42] /= 2  # half as large: stored, and it decodes near the values
    store_q4(rows, data, scale, 0, search=True)
    torch.testing.assert_close(dequantize_q4(data[:, :2], scale[:, :2]), rows, rtol=0.1, atol=0)


@pytest.mark.parametrize("kind", [StoreKind.Q4, StoreKind.Q4H])
def test_the_cache_searches_for_q4h_only(kind):
    x = rows_to_search(3)[:, :, :128]
    store = RowStore.empty(kind, 3, 32, 128, torch.device("cpu"))
    store.write(0, x)  # in the store's basis already: the search is on these rows
    codes, d16 = quantize_q4(x, search=kind.scale_search)
    assert torch.equal(unpack_q4(store.data[:, :24]), codes)
    assert torch.equal(store.scale[:, :24].view(torch.int16), d16.view(torch.int16))
    assert kind.scale_search == (kind == StoreKind.Q4H)


def test_a_searched_step_is_at_most_a_quarter_of_the_block_max():
    """The range pre-check (kernels.q4store.first_fp16_overflow) skips the search for blocks under
    4 x 65504: that holds only if no searched step exceeds |max| / 4. The step is an average of
    x_i / l_i, each at most 1.5 / |iscale| (a value that rounds to l = ±1 from 1.5) or |max| / 7
    (clipped): blocks built to push it there, and random ones."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3000, 32, generator=gen) * torch.rand(3000, 1, generator=gen).pow(4)
    lone = torch.zeros(200, 32)
    lone[:, 0] = 7.1  # the max, with values near 1.5 / iscale: l = ±1 carries a ratio near |max| / 4.7
    lone[:, 1:] = torch.linspace(1.2, 1.55, 200).unsqueeze(1) * torch.tensor([1.0, -1.0] * 15 + [1.0])
    _, d16 = quantize_q4(torch.cat((x, lone)), search=True)
    peak = torch.cat((x, lone)).abs().amax(-1)
    assert (d16.float().squeeze(-1).abs() <= peak / 4).all()

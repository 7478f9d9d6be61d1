"""pack_bits packs along the last dimension whatever the leading ones: a 3-D tensor packs as its 2-D
slices do, and round-trips; and a KV mode formats like its name (alignment specs included)."""

import pytest
import torch

from kvlens.kv.modes import KVMode
from kvlens.kv.nbit import pack_bits, unpack_bits


@pytest.mark.parametrize("bits", [5, 6, 7])
def test_leading_dimensions_do_not_change_the_packing(bits):
    half = 1 << (bits - 1)
    codes = torch.randint(
        -half, half, (3, 5, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(bits)
    )
    packed = pack_bits(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8)
    assert torch.equal(packed, torch.stack([pack_bits(c, bits) for c in codes]))
    assert torch.equal(unpack_bits(packed, bits), codes)


def test_a_mode_formats_as_its_name():
    mode = KVMode.parse("q8")
    assert f"{mode}|{mode:>4}|{mode:<4}|" == "q8|  q8|q8  |"

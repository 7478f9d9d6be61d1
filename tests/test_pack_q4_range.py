"""pack_q4 takes the 16 codes -8..7 and refuses every other int8, each end included (a code past
them would wrap into its neighbour's nibble); test_kv_rotated_q4 checks the layout of the 16."""

import pytest
import torch

from kvlens.kv.quant import pack_q4, unpack_q4


def test_every_code_outside_minus_8_to_7_is_refused():
    for code in (c for c in range(-128, 128) if not -8 <= c <= 7):
        codes = torch.zeros(2, 32, dtype=torch.int8)
        codes[1, 31] = code
        with pytest.raises(ValueError, match=r"4-bit codes must lie in -8\.\.7"):
            pack_q4(codes)


def test_both_ends_are_kept():
    codes = torch.tensor([[-8, 7] * 16], dtype=torch.int8)
    assert torch.equal(unpack_q4(pack_q4(codes)), codes)

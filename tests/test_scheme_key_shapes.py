"""Per-channel key schemes (KIVI: K grouped over tokens) take any ``[..., L, d]`` tensor, a plain
``[L, d]`` one included, and refuse a 1-D one; a per-token scheme takes a 1-D row."""

import pytest
import torch

from kvlens.kv.schemes import SCHEMES


@pytest.mark.parametrize("name", ["kivi", "kivi4"])
def test_a_2d_key_tensor_is_quantized_as_its_3d_twin(name):
    scheme = SCHEMES[name]
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    assert torch.equal(scheme.fake_quant(x, "k"), scheme.fake_quant(x[None], "k")[0])
    with pytest.raises(ValueError, match=r"quantizes keys per channel: give a \[\.\.\., L, d\] tensor"):
        scheme.quantize(x[0], "k")


def test_a_per_token_scheme_takes_a_row():
    row = torch.linspace(-1, 1, 64)
    assert torch.equal(SCHEMES["q8"].fake_quant(row, "k"), SCHEMES["q8"].fake_quant(row[None], "k")[0])

"""``lab unit --attn-backend`` with one tensor quantized: the kernel reads q8 rows for that tensor
only, the other exact, as the reference side does (float64 attention over the q8 K and exact V, or
the reverse, is what the kernel must return). And the integer kernel on every CPU path the host has:
the VNNI paths shift the query codes and need the K store's code sums."""

from __future__ import annotations

import pytest
import torch
from test_int_attention import PATH_PARAMS
from test_lab_unit import _q8, attention_f64
from test_lab_unit import test_attn_backend_runs_the_kernel_on_the_quantized_side as kernel_side_matches

from kvlens.lab import unit
from kvlens.lab.unit import UnitConfig


@pytest.mark.parametrize("quantize", ["k", "v"])
def test_only_the_named_tensor_is_stored_as_q8(quantize):
    cfg = UnitConfig(seq_len=[100], heads=4, kv_heads=2, head_dim=64, quantize=quantize, attn_backend="numba")
    q, k, v = unit.synthetic_qkv(cfg, 100, 0)
    r = unit.run_trial(cfg, q, k, v)
    kq, vq = (c * s for c, s in map(_q8, (k, v)))
    want = attention_f64(q, kq if quantize == "k" else k, vq if quantize == "v" else v)
    # f32 arithmetic in the kernel over |scores| of a few units: 1e-5 absolute with headroom
    torch.testing.assert_close(r["out_q"].double(), want, rtol=0, atol=1e-5)
    assert r["metrics"]["kernel_rel_l2"] < 1e-5  # the kernel adds only its own f32 rounding


@pytest.mark.parametrize("path", PATH_PARAMS)
@pytest.mark.parametrize("qbits", ["", "16"])
def test_the_integer_kernel_on_each_cpu_path(path, qbits):
    kernel_side_matches(f"numba-int{qbits}:{path}", "int16 per row" if qbits else "int8 per 32")

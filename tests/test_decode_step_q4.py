"""The fused decode step (kernels/decode_step.py) over the rotated and 4-bit kinds (q8h, q4, q4h, mixed
K/V), through the float kernel and the 8-bit integer one (numba-int over 4-bit K): logits and cache
contents bit-identical to the general path, step after step (as test_decode_step.py for q8/f16/f32).
"""

from __future__ import annotations

import pytest
import torch
from test_decode_step import Spy, assert_same_steps, decode_steps, refusals_of_both_paths
from tiny_models import write_hf

import kvlens


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    """A Llama with head_dim 64 (the 4-bit integer scores' step), two query heads on one KV head."""
    out = tmp_path_factory.mktemp("llama64")
    write_hf("llama", out, seed=7, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    return out


CASES = [("numba", kv) for kv in ("q8h", "q4", "q4h", "k=q8h,v=q4h", "k=q4h,v=f16", "k=f32,v=q4h")] + [
    ("numba-int", kv) for kv in ("q4", "q4h", "k=q4h,v=q8h", "k=q4,v=f16")
]


# every KV kind over int4 weights; f32 weights (another matvec specialization, orthogonal to the KV
# kinds) with one case per backend: each case compiles its own step, and compiling is the cost
WEIGHT_CASES = [(b, kv, "int4") for b, kv in CASES] + [
    ("numba", "q4h", "f32"),
    ("numba-int", "k=q4h,v=q8h", "f32"),
]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("backend,kv,weights", WEIGHT_CASES)
def test_fused_step_new_kinds_bit_identical(tiny64, backend, kv, weights):
    llm = kvlens.load(tiny64, kv=kv, weights=weights, attn_backend=backend)
    assert_same_steps(llm, list(range(3, 40)), kv)


@pytest.mark.usefixtures("one_thread")
def test_q4_block_out_of_fp16_range_is_refused_like_the_general_path(tiny64):
    """A layer whose K blocks outgrow the fp16 scale stops the step with store_q4's error, storing
    none of that layer's rows."""
    llm = kvlens.load(tiny64, kv="q4h", attn_backend="numba-int")
    ids = list(range(3, 20))

    def spoil(norm: torch.Tensor) -> None:
        norm.mul_(1e7)  # layer 1's K and V: finite, far past 8 x 65504

    runs = refusals_of_both_paths(
        llm, "q4h", ids, spoil, ValueError, "overflows the fp16 searched scale of a block"
    )
    for _, cache, before in runs:
        assert torch.equal(cache.k[1].data, before[1])
    assert runs[0][0] == runs[1][0]


@pytest.mark.usefixtures("one_thread")
def test_numba_int_over_int8_k_runs_the_general_path(tiny64):
    """numba-int (8-bit query) over an int8 K: the fused step has no such kind and steps aside."""
    llm = kvlens.load(tiny64, kv="q8", attn_backend="numba-int")
    spy = Spy(llm)
    fused, _ = decode_steps(llm, list(range(3, 30)), "q8", 2, True)
    plain, _ = decode_steps(llm, list(range(3, 30)), "q8", 2, False)
    assert spy.calls == 0 and all(torch.equal(a, b) for a, b in zip(fused, plain, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("backend,kv", [("numba-int", "q4h"), ("numba", "k=q8h,v=q4h")])
def test_smollm2_fused_step_new_kinds_bit_identical(smol_loaded, backend, kv):
    """The real model (hd 64, 9 query heads on 3 KV heads), two threads, past the attention's serial
    threshold (Flash-Decoding splits), the rotated 4-bit cache through both kernels."""
    llm = kvlens.LLM(smol_loaded, kv=kv, attn_backend=backend)
    text = "The history of the printing press begins in the fifteenth century. " * 60
    ids = llm.tokenizer.encode(text)[:700]
    assert len(ids) == 700
    assert_same_steps(llm, ids, kv, steps=2)

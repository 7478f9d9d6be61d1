"""The integer attention backends need head_dim divisible by 32 (the query is quantized, and an int8
K's code sums kept, per 32 values). A model whose head_dim is not (the suite's tiny Llama: 16) loaded
with `numba-int` failed at its first decode step, after the prefill, and on a VNNI CPU with another
error than elsewhere ("needs the K store's ksum"); in the serving engine every request failed while it
ran. Now the load refuses it, and the kernel's own refusal reads the same on every CPU."""

from __future__ import annotations

import re

import pytest
import torch

import kvlens
from kvlens.engine.attention import BackendError
from kvlens.kernels.cpu_int import IntAttn, decode_attention_int
from kvlens.kv.kinds import StoreKind
from kvlens.kv.stores import RowStore

TINY_MODEL = ("llama", 5)  # conftest's tiny_dir: head_dim 16


@pytest.mark.parametrize("backend", ["numba-int", "numba-int16", "numba-int+pv8"])
def test_an_integer_backend_is_refused_at_load_for_a_head_dim_it_cannot_split(tiny_dir, tiny, backend):
    assert tiny.config.head_dim == 16
    message = rf"^the {re.escape(backend)} backend needs head_dim divisible by 32 .*; this model's is 16"
    with pytest.raises(BackendError, match=message):
        kvlens.load(tiny_dir, kv="q8", attn_backend=backend)
    with pytest.raises(BackendError, match=message):
        tiny.variant(attn_backend=backend)
    assert tiny.variant(attn_backend="numba").attn_backend == "numba"  # the float kernels take it


def test_the_kernel_refuses_such_a_head_dim_with_the_same_words_on_every_cpu():
    k, v = (RowStore.empty(StoreKind.Q8, 1, 8, 16, torch.device("cpu")) for _ in range(2))
    for spec in (IntAttn.parse("numba-int"), IntAttn.parse("numba-int16")):
        with pytest.raises(ValueError, match="^integer attention needs head_dim divisible by 32, got 16$"):
            decode_attention_int(torch.ones(2, 16), k, v, 4, spec=spec)

"""Which attention path a call takes, and what it hands the kernel: a one-token prefill chunk of the
mirror mode reads the exact copy; a layer stored per KV head gives each head its own block selection
and sink rows; an integer backend refuses a recipe with any layer it cannot score."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvlens.engine.attention import BackendError
from kvlens.kv.blocks import SparseConfig
from kvlens.kv.modes import KVMode, StoreKind
from kvlens.kv.recipe import head_recipe_mode

TINY_MODEL = ("qwen3", 5)  # conftest's tiny: 2 layers, 2 KV heads, head_dim 32
IDS = torch.randint(5, 300, (224,), generator=torch.Generator().manual_seed(7)).tolist()


def test_one_token_prefill_chunks_of_the_mirror_mode_read_the_exact_copy(tiny):
    """Prefill in chunks of one token: each is a prefill call with one query row, which a decode step
    also has. q8+mirror's exact prefill equals the f32 cache's bit for bit; plain q8 does not."""
    llm = tiny.variant(attn_backend="numba")
    f32 = llm.logits(IDS[:8], kv="f32", prefill_chunk=1)
    assert torch.equal(llm.logits(IDS[:8], kv="q8+mirror", prefill_chunk=1), f32)
    assert not torch.equal(llm.logits(IDS[:8], kv="q8", prefill_chunk=1), f32)


def sparse_decode_logits(llm, steps: int = 3) -> torch.Tensor:
    cache = llm.new_cache(len(IDS) + steps)
    logits, out = llm.prefill(IDS, cache), []
    for i in range(steps):
        tok = int(logits.argmax())
        logits = llm.lm_head(llm.forward([tok], cache, len(IDS) + i, prefill=False))[0]
        out.append(logits)
    return torch.stack(out)


PER_HEAD = [
    [(StoreKind.Q8, StoreKind.F16), (StoreKind.F16, StoreKind.Q8)],
    [(StoreKind.Q8, StoreKind.Q8)] * 2,
]


@pytest.mark.parametrize(
    ("keep_sink", "sparse"),
    [
        (0, SparseConfig("quest", 128, 0, 0)),  # 4 of 7 blocks: the two heads choose differently
        (8, None),  # each head reads its own K and V sink rows
    ],
)
def test_a_layer_stored_per_head_hands_each_head_its_own_blocks_and_sink(tiny, keep_sink, sparse):
    """Layer 0 stored per KV head (q8 K / f16 V, then the reverse): the decode kernel, one call per
    head, equals the torch path's per-head masks and sink rows up to f32 rounding, through the
    one-call attention step and without it (``fused_step`` off: the kernel called per head)."""
    mode = dataclasses.replace(head_recipe_mode("per-head", PER_HEAD), keep_sink=keep_sink)
    want = sparse_decode_logits(tiny.variant(kv=mode, sparse=sparse, attn_backend="torch"))
    for fused_step in (True, False):
        llm = tiny.variant(kv=mode, sparse=sparse, attn_backend="numba", fused_step=fused_step)
        assert (sparse_decode_logits(llm) - want).abs().max().item() < 1e-4, f"fused_step={fused_step}"


def test_an_integer_backend_refuses_a_recipe_with_any_layer_it_cannot_score(tiny):
    f16_first = KVMode(
        "mixed",
        StoreKind.Q8,
        StoreKind.Q8,
        layers=((StoreKind.F16, StoreKind.Q8), (StoreKind.Q8, StoreKind.Q8)),
    )
    with pytest.raises(BackendError, match="numba-int16 backend needs an int8 K cache"):
        tiny.variant(kv=f16_first, attn_backend="numba-int16").logits(IDS[:8])
    all_int8 = dataclasses.replace(f16_first, layers=((StoreKind.Q8, StoreKind.Q8),) * 2)
    assert tiny.variant(kv=all_int8, attn_backend="numba-int16").logits(IDS[:8]).isfinite().all()


@pytest.mark.parametrize("mode", ["k=q6h,v=q8", "k=q8,v=q6h"])
def test_an_integer_backend_refuses_packed_rows_in_k_or_v(tiny, mode):
    with pytest.raises(BackendError, match="numba-int16 backend cannot read q6h rows"):
        tiny.variant(kv=mode, attn_backend="numba-int16").logits(IDS[:8])

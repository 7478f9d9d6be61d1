"""Which attention path a call takes, and what it hands the kernel: a one-token prefill chunk of the
mirror mode reads the exact copy; a layer stored per KV head gives each head its own block selection
and sink rows; an integer backend refuses a recipe with any layer it cannot score."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from bounds import f32_forward_tol

from kvlens.engine.attention import BackendError, resolve_backend
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
    head, equals the torch path's per-head masks and sink rows up to f32 rounding (bounds.py), through the
    one-call attention step and without it (``fused_step`` off: the kernel called per head)."""
    mode = dataclasses.replace(head_recipe_mode("per-head", PER_HEAD), keep_sink=keep_sink)
    want = sparse_decode_logits(tiny.variant(kv=mode, sparse=sparse, attn_backend="torch"))
    tol = 2 * f32_forward_tol(tiny.config, want)  # two f32 passes over the same stored rows
    for fused_step in (True, False):
        llm = tiny.variant(kv=mode, sparse=sparse, attn_backend="numba", fused_step=fused_step)
        assert (sparse_decode_logits(llm) - want).abs().max().item() <= tol, f"fused_step={fused_step}"


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


@pytest.mark.parametrize("backend", ["numba", "numba-int16", "numba-int:portable"])
def test_cpu_backends_are_refused_for_a_cuda_device(backend):
    """Decided from the device alone, so this runs without a GPU."""
    with pytest.raises(BackendError, match="runs on CPU tensors only"):
        resolve_backend(backend, torch.device("cuda"))
    assert resolve_backend(backend, torch.device("cpu")) == backend


def test_auto_is_the_numba_kernel_on_the_cpu(tiny):
    """numba is a dependency, so `auto` on the CPU is its fused kernel, never the torch fallback."""
    assert resolve_backend("auto", torch.device("cpu")) == "numba"
    assert tiny.variant(attn_backend="auto").attn_backend == "numba"


def test_a_sparse_engine_refuses_a_cache_without_block_bounds(tiny):
    sparse = tiny.variant(sparse=SparseConfig("quest", 32, 0, 0))
    cache = tiny.new_cache(80)  # the dense engine's: no bounds
    sparse.prefill(IDS[:64], cache)
    with pytest.raises(ValueError, match="sparse decode needs a cache that tracks block bounds"):
        sparse.forward([5], cache, 64, prefill=False)


def test_paged_decode_past_a_window_reads_each_sequences_own_blocks(tmp_path):
    """The scheduler's paged sequences on the torch backend past Mistral's window (4): two requests
    at once, so the second's blocks are not the pool's first; every token's logits equal transformers'
    in float64 over that sequence."""
    from test_batch_invariance import _together
    from tiny_models import write_hf

    import kvlens
    from kvlens.engine.scheduler import EngineConfig
    from kvlens.engine.sequence import Request

    hf = write_hf("mistral", tmp_path, sliding_window=4).double()
    llm = kvlens.load(str(tmp_path), kv="f32", attn_backend="torch")
    prompts = {"a": IDS[:40], "b": IDS[40:75]}
    reqs = [Request(rid, ids, 5, stop_ids=frozenset()) for rid, ids in prompts.items()]
    events = _together(llm, reqs, EngineConfig(kv_budget_bytes=1 << 22, keep_logits=True))
    for rid, ids in prompts.items():
        seq = ids + [e.token_id for e in events[rid][:-1]]
        with torch.no_grad():
            want = hf(torch.tensor([seq])).logits[0, len(ids) - 1 :]
        got = torch.stack([e.logits for e in events[rid]]).double()
        assert (got - want).abs().max().item() <= f32_forward_tol(llm.config, want), rid

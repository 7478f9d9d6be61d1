"""A decode step's attention as one compiled call per layer (kernels/attend_step.py, through
engine.fused_step.attend_fused) for layers the fused step does not run: Gemma-3's (QK-norm, sliding
windows). It runs the general path's kernels in the same order on the same values (write, turn,
Flash-Decoding, turn back), so logits and cache contents must be bit-identical to the general path's
(``LLM.fused_step = False``, which test_gemma3.py holds to transformers), step after step, windows
reached or not, contiguous or paged.
"""

from __future__ import annotations

import pytest
import torch
from test_decode_step import Spy, refusals_of_both_paths
from tiny_models import write_gemma3

import kvlens
from kvlens.engine.model_runner import ModelRunner
from kvlens.kv.cache import NonFiniteKVError
from kvlens.kv.modes import CacheOptions, StoreKind
from kvlens.kv.pool import BlockPool, PagedKV, kv_bytes_per_token
from kvlens.kv.recipe import head_recipe_mode, with_k_center

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = [2, 5, 17, 200, 33, 41, 9, 128, 77, 64, 3, 250, 199, 7, 90]  # past the window of 4
F16, Q8, Q8H, Q4, Q4H = (StoreKind(x) for x in ("f16", "q8", "q8h", "q4", "q4h"))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """A tiny Gemma-3 (5 windowed layers of window 4, then a global one; head_dim 256; 1 KV head)."""
    _, path = write_gemma3(tmp_path_factory.mktemp("gemma3") / "tiny.gguf", sliding_window=4)
    return kvlens.load(path, kv="f32", attn_backend="numba")


def decode(llm, kv, fused: bool, paged: bool = False, steps: int = 8) -> tuple[list[torch.Tensor], object]:
    """Logits of a prefill of IDS[:-steps] and then one decode step per remaining id, and the cache."""
    llm.fused_step = fused
    n = len(IDS) - steps
    if paged:
        cfg = llm.config
        pool = BlockPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, kv, 8 * 32 * kv_bytes_per_token(kv, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim))  # fmt: skip
        PagedKV(pool).grow(40)  # another sequence's blocks first: the table does not start at block 0
        cache = PagedKV(pool)
        cache.grow(len(IDS))
    else:
        cache = llm.new_cache(len(IDS), kv)
    try:
        logits = [llm.prefill(IDS[:n], cache)]
        for pos in range(n, len(IDS)):
            logits.append(llm.lm_head(llm.forward([IDS[pos]], cache, pos, prefill=False))[0])
    finally:
        llm.fused_step = True
    return logits, cache


def stores_of(cache) -> list:
    """Every store a cache writes: K, V, then the sink store's (a paged view's are its pool's)."""
    owner = getattr(cache, "pool", cache)
    return owner.k + owner.v + owner.k_sink + owner.v_sink


def assert_same_steps(llm, kv, paged: bool = False, one_call: bool = True, calls: int | None = None) -> None:
    """The 8 decode steps' logits and stored rows (sink store included) bit-identical with the one call
    and without; ``calls``: how many layer steps took it (default: all with ``one_call``, else none)."""
    spy = Spy(llm._attend_step)
    calls = (8 * llm.config.n_layers if one_call else 0) if calls is None else calls
    fused, c1 = decode(llm, kv, True, paged)
    assert spy.calls == calls
    plain, c2 = decode(llm, kv, False, paged)
    assert spy.calls == calls  # none with fused_step off
    for a, b in zip(fused, plain, strict=True):
        assert torch.equal(a, b)
    assert c1.length == c2.length == len(IDS)
    for s1, s2 in zip(stores_of(c1), stores_of(c2), strict=True):
        for name in ("data", "scale", "ksum"):
            if getattr(s1, name, None) is not None:
                assert torch.equal(getattr(s1, name), getattr(s2, name)), name


@pytest.mark.parametrize(
    "kv, backend",
    [("f32", "numba"), ("f16", "numba"), ("q8", "numba"), ("q8", "numba-int16"), ("q8h", "numba"),
     ("q4", "numba-int"), ("q4h", "numba"), ("q4h", "numba-int"), ("k=q8h,v=q4h", "numba"), ("q6h", "numba"),
     ("k=q7h,v=q5h", "numba")],
)  # fmt: skip
def test_one_call_attention_is_bit_identical_to_the_general_path(gemma, kv, backend):
    llm = gemma.variant(kv=kv, attn_backend=backend)
    assert_same_steps(llm, llm.kv)


@pytest.mark.parametrize("kv", ["q8", "q4h"])
def test_paged_one_call_attention_is_bit_identical(gemma, kv):
    llm = gemma.variant(kv=kv)
    assert_same_steps(llm, llm.kv, paged=True)


def test_a_recipe_with_k_centers_is_bit_identical(gemma):
    """Per-layer kinds and K smoothing's centers (subtracted before the rotation, in the same call)."""
    layers = [[(Q4H, Q8)], [(Q8H, Q4H)], [(F16, Q4)], [(Q4H, Q4H)], [(Q8, F16)], [(Q4H, Q8H)]]
    cfg = gemma.config
    center = torch.randn(
        cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, generator=torch.Generator().manual_seed(1)
    )
    mode = with_k_center(head_recipe_mode("r", layers), 3 * center)
    assert_same_steps(gemma.variant(kv=mode), mode)


def test_the_serving_runner_takes_the_one_call_attention(gemma):
    """A batch of two sequences (the runner's batched rows) over the pool: each sequence's attention one
    call per layer, the logits those of each sequence alone through the general path (its position
    written again)."""
    llm = gemma.variant(kv="q4h")
    cfg = llm.config
    pool = BlockPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, llm.kv, 8 * 32 * kv_bytes_per_token(llm.kv, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim))  # fmt: skip
    seqs = [PagedKV(pool), PagedKV(pool)]
    prompts = [IDS[:9], IDS[3:14]]
    for seq, ids in zip(seqs, prompts, strict=True):
        seq.grow(len(ids) + 1)
        llm.prefill(ids, seq)
    spy = Spy(llm._attend_step)
    rows = ModelRunner(llm).decode(seqs, [7, 11], [len(p) for p in prompts])
    assert spy.calls == 2 * cfg.n_layers
    llm.fused_step = False
    try:
        for seq, ids, tok, row in zip(seqs, prompts, [7, 11], rows, strict=True):
            alone = llm.lm_head(llm.forward([tok], seq, len(ids), prefill=False))[0]
            assert torch.equal(row, alone)  # batch invariance (engine.model_runner)
    finally:
        llm.fused_step = True


@pytest.mark.parametrize("kv", ["q8", "q4h"])
def test_non_finite_kv_is_refused_like_the_general_path(gemma, kv):
    """A layer whose K turns non-finite stops the step with the general path's error, nothing stored."""
    llm = gemma.variant(kv=kv)

    def spoil(norm: torch.Tensor) -> None:
        norm[0] = float("inf")

    runs = refusals_of_both_paths(llm, kv, IDS[:10], spoil, NonFiniteKVError, "non-finite K value at layer 1")
    n = llm.config.n_layers
    for _, cache, before in runs:
        after = [s.data for s in cache.k + cache.v]
        assert torch.equal(after[1], before[1]) and torch.equal(after[n + 1], before[n + 1])  # layer 1's K, V
        assert cache.length == 10
    assert runs[0][0] == runs[1][0]


@pytest.mark.parametrize(
    "kv, backend, options",
    [("bf16", "numba", None), ("q8+mirror", "numba", None), ("q8", "numba-int", None),
     ("q8", "torch", None), ("q8", "numba", CacheOptions(keep_recent=2))],
)  # fmt: skip
def test_what_the_call_does_not_read_runs_the_general_path(gemma, kv, backend, options):
    """A kind it does not store (bf16), a mirror or kept-exact rows, the 8-bit query over int8 K and
    the torch backend: the general path, as with fused_step off."""
    llm = gemma.variant(kv=kv, attn_backend=backend, cache_options=options or CacheOptions())
    assert_same_steps(llm, llm.kv, one_call=False)


@pytest.mark.parametrize(
    "kv, backend, sink, calls",
    [("q8", "numba", 2, 48), ("q4h", "numba", 6, 38), ("k=q6h,v=q4h", "numba", 9, 21), ("q8", "numba-int16", 2, 48),
     ("q4h", "numba-int", 3, 48)],
)  # fmt: skip
def test_a_sink_store_is_read_by_the_call(gemma, kv, backend, sink, calls):
    """A sink store (the first ``sink`` positions kept in f16, read in place of the stores' rows): the
    global layer reads its rows in the call; a windowed layer whose window has left them behind reads
    none; where the general path must run the step, it does: a position the sink store still takes (7
    and 8 for a sink of 9: every layer), a window that still reaches the sink (the 5 windowed layers at
    positions 7..8 for a sink of 6, 9..11 for 9). The integer kinds read the sink from the query they
    scale as ``cpu_int`` does. Bit-identical either way, sink store included."""
    llm = gemma.variant(kv=kv, attn_backend=backend, cache_options=CacheOptions(keep_sink=sink))
    assert_same_steps(llm, llm.kv, calls=calls)


@pytest.fixture(scope="module")
def gemma128(tmp_path_factory):
    """The tiny Gemma-3 at head_dim 128, where 1/sqrt(d) is not a power of two: the float kinds scale
    the query by a product, the integer kinds by a division, and the two differ in the last bit."""
    _, path = write_gemma3(
        tmp_path_factory.mktemp("gemma3-128") / "tiny.gguf", sliding_window=4, head_dim=128
    )
    return kvlens.load(path, kv="f32", attn_backend="numba")


@pytest.mark.parametrize("kv, backend", [("q8", "numba"), ("q8", "numba-int16"), ("q4h", "numba-int")])
def test_a_sink_store_is_read_with_each_kinds_own_query_scale(gemma128, kv, backend):
    """At head_dim 128 the sink's softmax state must come from the query exactly as each general
    kernel scales it (``cpu``: times 1/sqrt(d); ``cpu_int``: divided by sqrt(d)): bit-identical."""
    llm = gemma128.variant(kv=kv, attn_backend=backend, cache_options=CacheOptions(keep_sink=2))
    assert_same_steps(llm, llm.kv)

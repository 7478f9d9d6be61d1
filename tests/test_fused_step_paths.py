"""The edges of the one-call-per-layer decode step's conditions (engine/fused_step.py): where it runs it
equals the general path (``LLM.fused_step = False``) bit for bit, and where it must step aside the
general path's answer or error is what the caller gets.

test_decode_step.py holds the fused step to the general path on caches sized ahead and well inside
every window; these tests take the edges: a cache grown by the step itself, the first position a
window cuts, a paged view one block short, an odd int4 width, kernels that cannot score a layer's K.
"""

from __future__ import annotations

import pytest
import torch
from test_decode_step import Spy
from tiny_models import write_hf

import kvlens
from kvlens.engine.attention import BackendError
from kvlens.kv.cache import BLOCK
from kvlens.kv.modes import KVMode
from kvlens.kv.pool import BlockPool, PagedKV, kv_bytes_per_token
from kvlens.kv.recipe import head_recipe_mode
from kvlens.kv.stores import StoreKind

pytestmark = pytest.mark.usefixtures("one_thread")


def step_logits(
    llm, ids: list[int], steps: int, fused: bool, capacity: int
) -> tuple[list[torch.Tensor], object]:
    """Greedy logits of a prefill of ``ids`` and ``steps`` one-token steps on a cache made for
    ``capacity`` positions (the steps grow it past that), with the fused step on or off; and the cache."""
    cache = llm.new_cache(capacity)
    logits = [llm.prefill(ids, cache)]
    llm.fused_step = fused
    try:
        for i in range(steps):
            tok = int(logits[-1].argmax())
            logits.append(llm.lm_head(llm.forward([tok], cache, len(ids) + i, prefill=False))[0])
    finally:
        llm.fused_step = True
    return logits, cache


def assert_paths_agree(llm, ids: list[int], steps: int, capacity: int) -> None:
    fused, c1 = step_logits(llm, ids, steps, True, capacity)
    plain, c2 = step_logits(llm, ids, steps, False, capacity)
    for i, (a, b) in enumerate(zip(fused, plain, strict=True)):
        assert torch.equal(a, b), f"logits after step {i}"
    assert c1.length == c2.length == len(ids) + steps
    for s1, s2 in zip(c1.k + c1.v, c2.k + c2.v, strict=True):
        for p1, p2 in zip(getattr(s1, "parts", [s1]), getattr(s2, "parts", [s2]), strict=True):
            assert torch.equal(p1.data[:, : c1.length], p2.data[:, : c2.length])


def test_a_step_past_the_cache_capacity_grows_it_first(tmp_path):
    """A prompt that fills the cache's last block: the fused step must grow the cache before its
    compiled call writes the next position (the general path's write grows it)."""
    write_hf("llama", tmp_path, seed=5)
    llm = kvlens.load(str(tmp_path), kv="q8", weights="int8", attn_backend="numba")
    spy = Spy(llm)
    ids = [3 + i % 200 for i in range(BLOCK)]
    assert llm.new_cache(BLOCK).capacity == BLOCK
    assert_paths_agree(llm, ids, steps=3, capacity=BLOCK)
    assert spy.calls == 3  # every step of the first run was fused


def test_the_first_position_a_window_cuts_takes_the_windowed_path(tmp_path):
    """Mistral's sliding window of 4: the steps at positions 2..7 cross the first position whose query
    no longer attends everything before it (position 4); each step equals the general path."""
    window = 4
    write_hf("mistral", tmp_path, sliding_window=window)
    llm = kvlens.load(str(tmp_path), kv="q8", attn_backend="numba")
    spy = Spy(llm)
    assert_paths_agree(llm, [5, 17], steps=6, capacity=16)
    assert spy.calls == window - 2  # positions 2 and 3: the window still holds every position


def test_a_layer_stored_per_head_gives_each_head_its_own_query_group(tmp_path):
    """8 query heads over 2 KV heads (groups of 4, not 2 = the KV head count as in the other tiny
    models), each layer's KV heads stored in different kinds: the one-call-per-KV-head attention hands
    each call its own 4 query heads; the steps equal the general path."""
    q8, f16 = StoreKind.Q8, StoreKind.F16
    write_hf("llama", tmp_path, seed=5, hidden_size=128, num_attention_heads=8)
    mode = head_recipe_mode("r", [[(q8, f16), (f16, q8)], [(f16, f16), (q8, q8)]])
    llm = kvlens.load(str(tmp_path), kv=mode, weights="int8", attn_backend="numba")
    assert (llm.config.n_heads, llm.config.n_kv_heads) == (8, 2)
    spy = Spy(llm._attend_step.head_step)
    assert_paths_agree(llm, list(range(3, 30)), steps=3, capacity=32)
    assert spy.calls == 3 * 2 * 2  # steps x layers x KV heads, in the fused run


def test_a_paged_view_one_block_short_is_refused_and_nothing_is_written(tmp_path):
    """A sequence holding one block, full, asked to decode the next position: the general path's
    ValueError, the pool (another sequence's block included) left as it was."""
    write_hf("llama", tmp_path, seed=5)
    llm = kvlens.load(str(tmp_path), kv="q8", weights="int8", attn_backend="numba")
    cfg, mode = llm.config, llm.kv
    per_token = kv_bytes_per_token(mode, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
    pool = BlockPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, mode, 4 * BLOCK * per_token)
    seqs = [PagedKV(pool), PagedKV(pool)]
    for n, kv in enumerate(seqs):
        kv.blocks = pool.allocate(1)
        llm.forward([3 + (n + i) % 200 for i in range(BLOCK)], kv, 0)
    before = [s.data.clone() for s in pool.k + pool.v]
    for fused in (True, False):
        llm.fused_step = fused
        try:
            with pytest.raises(ValueError, match="need blocks the sequence does not hold"):
                llm.forward([7], seqs[0], BLOCK, prefill=False)
        finally:
            llm.fused_step = True
        assert seqs[0].length == BLOCK
        for a, b in zip(before, pool.k + pool.v, strict=True):
            assert torch.equal(a, b.data)


def test_an_odd_int4_input_width_decodes_as_the_general_path(tmp_path):
    """An FFN of 99 (the down projection's int4 input width odd; its last group of 32 holds three
    inputs, so their codes are not all zero): the steps equal the general path."""
    write_hf("llama", tmp_path, seed=5, intermediate_size=99)
    llm = kvlens.load(str(tmp_path), kv="q8", weights="int4", attn_backend="numba")
    assert_paths_agree(llm, list(range(3, 20)), steps=3, capacity=32)


def test_an_integer_backend_over_a_layer_it_cannot_score_is_refused_in_a_step(tmp_path):
    """numba-int16 scores int8 K only: a recipe whose first layer keeps K in f16 is refused in a
    one-token step (BackendError), as in a prefill; the second layer's int8 K does not let it run."""
    write_hf("llama", tmp_path, seed=5)
    mode = KVMode(
        "mixed",
        StoreKind.Q8,
        StoreKind.Q8,
        layers=((StoreKind.F16, StoreKind.Q8), (StoreKind.Q8, StoreKind.Q8)),
    )
    llm = kvlens.load(str(tmp_path), kv=mode, weights="int8", attn_backend="numba")
    cache = llm.new_cache(32)
    llm.prefill(list(range(3, 20)), cache)
    with pytest.raises(BackendError, match="numba-int16 backend needs an int8 K cache"):
        llm.forward([7], cache, 17, prefill=False, backend="numba-int16")
    assert cache.length == 17


@pytest.mark.parametrize("fused", [True, False])
def test_integer_scores_over_4bit_k_need_a_head_dim_of_64(tmp_path, fused):
    """numba-int scores 4-bit K in steps of 64 values: with head_dim 16 a step raises the kernel's
    ValueError on either path, rather than scoring a head it does not cover (head_dim 32: 4-bit K's
    block, half the kernel's step)."""
    write_hf("llama", tmp_path, seed=5, hidden_size=128)
    llm = kvlens.load(str(tmp_path), kv="q4", weights="int8", attn_backend="numba")
    assert llm.config.head_dim == 32
    cache = llm.new_cache(32)
    llm.prefill(list(range(3, 20)), cache)
    llm.fused_step = fused
    try:
        with pytest.raises(ValueError, match="need head_dim divisible by 64"):
            llm.forward([7], cache, 17, prefill=False, backend="numba-int")
    finally:
        llm.fused_step = True


def test_an_attention_output_outlives_the_next_call():
    """The one-call attention's output is the caller's own: a later call (the next layer, or the next
    sequence of a batch) leaves it as it was; it is not the step's scratch."""
    from kvlens.engine.attention import make_attend
    from kvlens.kernels.attend_step import AttendStep
    from kvlens.kv.cache import KVCache

    gen = torch.Generator().manual_seed(3)
    n_heads, n_kv, hd, n = 4, 2, 64, 20
    cache = KVCache(2, n_kv, hd, 32, KVMode.parse("q8"))
    step = AttendStep(n_heads, n_kv, hd)
    spy = Spy(step)
    attend = make_attend(cache, False, "numba", None, step=step)
    outs = []
    for layer in range(2):
        k, v = (torch.randn(n_kv, n, hd, generator=gen) for _ in range(2))
        cache.write(layer, 0, k[:, :-1], v[:, :-1])
        q = torch.randn(n_heads, 1, hd, generator=gen)
        outs.append(attend(layer, q, k[:, -1:], v[:, -1:], n - 1))
        if layer == 0:
            first = outs[0].clone()
    assert spy.calls == 2
    assert not torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], first)

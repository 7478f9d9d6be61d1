"""One compiled call per layer for one-token steps (kernels/decode_step.py) against the general path.

The general path (each layer's parts as separate calls, ``LLM.fused_step = False``) is held to HF
transformers' float64 logits by test_engine.py; the fused step runs the same kernels in the same order
on the same values, so its logits and cache contents must be bit-identical to it, step after step.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import write_hf

import kvlens
from kvlens.kernels import decode_step
from kvlens.kv.cache import BLOCK, NonFiniteKVError
from kvlens.kv.pool import BlockPool, PagedKV, kv_bytes_per_token


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """A Llama (Llama-3 RoPE scaling, untied head) and a Qwen2 (QKV bias) with random weights."""
    out = {}
    for arch, seed in (("llama", 5), ("qwen2", 6)):
        out[arch] = tmp_path_factory.mktemp(arch)
        write_hf(arch, out[arch], seed=seed)
    return out


class Spy:
    """Counts the ``run`` calls of a compiled step: an engine's FusedDecoder (the fused path really
    ran), or another object with a ``run``."""

    def __init__(self, llm_or_step) -> None:
        step = getattr(llm_or_step, "fused", llm_or_step)
        self.calls, inner = 0, step.run

        def run(*args):
            self.calls += 1
            return inner(*args)

        step.run = run


def decode_steps(llm, ids: list[int], kv: str, steps: int, fused: bool) -> tuple[list[torch.Tensor], object]:
    """Greedy logits of ``steps`` one-token steps after a prefill of ``ids``, and the cache."""
    llm.fused_step = fused
    cache = llm.new_cache(len(ids) + steps, kv)
    logits = [llm.prefill(ids, cache)]
    for i in range(steps):
        tok = int(logits[-1].argmax())
        logits.append(llm.lm_head(llm.forward([tok], cache, len(ids) + i, prefill=False))[0])
    llm.fused_step = True
    return logits, cache


def assert_same_steps(llm, ids: list[int], kv: str, steps: int = 3) -> None:
    spy = Spy(llm)
    fused, c1 = decode_steps(llm, ids, kv, steps, True)
    assert spy.calls == steps  # every decode step took the fused path
    plain, c2 = decode_steps(llm, ids, kv, steps, False)
    assert spy.calls == steps
    for a, b in zip(fused, plain, strict=True):
        assert torch.equal(a, b)
    assert c1.length == c2.length == len(ids) + steps
    for s1, s2 in zip(c1.k + c1.v, c2.k + c2.v, strict=True):
        assert torch.equal(s1.data, s2.data)
        for name in ("scale", "ksum"):
            if getattr(s1, name) is not None:
                assert torch.equal(getattr(s1, name), getattr(s2, name)), name


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    "arch, weights, kv",
    [("llama", w, "q8") for w in ("f32", "bf16", "int8", "int4")]
    + [("llama", "int4", kv) for kv in ("f16", "f32", "k=q8,v=f16")]
    + [("qwen2", "int8", "q8")],  # the QKV bias
)
def test_fused_step_is_bit_identical_to_the_general_path(tiny_dirs, arch, weights, kv):
    llm = kvlens.load(tiny_dirs[arch], kv=kv, weights=weights, attn_backend="numba")
    assert_same_steps(llm, list(range(3, 40)), kv)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numba", "numba-int16"])
def test_smollm2_fused_step_is_bit_identical(smol_loaded, backend):
    """The real model, GGUF weights as stored (int4 layers, int8 head), q8 cache, both kernels; two
    threads, a context past the attention's serial threshold (Flash-Decoding splits)."""
    llm = kvlens.LLM(smol_loaded, kv="q8", attn_backend=backend)
    text = "The history of the printing press begins in the fifteenth century. " * 60
    ids = llm.tokenizer.encode(text)[:700]
    assert len(ids) == 700
    assert_same_steps(llm, ids, "q8", steps=2)


def refusals_of_both_paths(llm, kv: str, ids: list[int], spoil, error: type, match: str) -> list[tuple]:
    """One decode step after ``ids`` with layer 1's ``attn_norm`` spoiled by ``spoil(norm)``, on the
    fused and then the general path: each must raise ``error`` matching ``match``. Returns, per path,
    (the message, the cache, its stores' tensors before the step)."""
    out = []
    for fused in (True, False):
        cache = llm.new_cache(len(ids) + 1, kv)
        llm.prefill(ids, cache)
        before = [s.data.clone() for s in cache.k + cache.v]
        norm = llm.model.w.layers[1].attn_norm
        saved = norm.clone()
        spoil(norm)
        llm.fused_step = fused
        try:
            with pytest.raises(error, match=match) as e:
                llm.forward([5], cache, len(ids), prefill=False)
        finally:
            norm.copy_(saved)
            llm.fused_step = True
        out.append((str(e.value), cache, before))
    return out


@pytest.mark.usefixtures("one_thread")
def test_non_finite_kv_is_refused_like_the_general_path(tiny_dirs):
    """A layer whose K turns NaN stops the step with the general path's error, storing none of it."""
    llm = kvlens.load(tiny_dirs["llama"], kv="q8", attn_backend="numba")
    ids = list(range(3, 20))

    def spoil(norm: torch.Tensor) -> None:
        norm[0] = float("inf")  # layer 1's normed input, hence its Q, K and V, turn non-finite

    runs = refusals_of_both_paths(
        llm, "q8", ids, spoil, NonFiniteKVError, "non-finite K value at layer 1, position 17"
    )
    for _, cache, before in runs:
        after = [s.data for s in cache.k + cache.v]
        assert torch.equal(after[1], before[1]) and torch.equal(after[3], before[3])  # layer 1's K, V
        assert cache.length == len(ids)
    assert runs[0][0] == runs[1][0]


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs two numba threads")
def test_thread_count_is_restored(tiny_dirs):
    """Small matmuls and short attention run on one thread inside the compiled call (the
    threading layer's own functions, called by symbol): the count is put back after each."""
    llm = kvlens.load(tiny_dirs["llama"], kv="q8", attn_backend="numba")
    threads = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        cache = llm.new_cache(20, "q8")
        llm.prefill(list(range(3, 19)), cache)
        llm.forward([5], cache, 16, prefill=False)
        assert numba.get_num_threads() == 2
    finally:
        numba.set_num_threads(threads)


finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(st.lists(finite_f32, min_size=1, max_size=64))
def test_f16_bits_round_like_torch(values):
    x = np.asarray(values, np.float32)
    expect = torch.from_numpy(x).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    got = np.array([decode_step.f32_to_f16_bits(v) for v in x], np.uint16)
    assert np.array_equal(got, expect)


def test_f16_bits_at_the_edges():
    """Ties (even and odd), the subnormal range, the largest finite value and the overflow point."""
    ulp = 2.0**-24
    edges = [0.0, -0.0, ulp / 2, ulp * 1.5, ulp * 2.5, 2.0**-14 * (1 - 2**-11), 1 + 2**-11, 1 + 3 * 2**-11,
             65504.0, 65519.0, 65520.0, -65520.0, 1e-8, -3e-6, 3.0e38]  # fmt: skip
    x = np.asarray(edges, np.float32)
    expect = torch.from_numpy(x).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    got = np.array([decode_step.f32_to_f16_bits(v) for v in x], np.uint16)
    assert np.array_equal(got, expect)


@pytest.mark.usefixtures("one_thread")
def test_serving_engine_runs_one_sequence_fused(tiny_dirs):
    """A request alone goes through the paged pool (block table) and the fused step; the tokens are
    the general path's (test_batch_invariance holds a sequence's logits alone and in a batch equal)."""
    llm = kvlens.load(tiny_dirs["llama"], kv="q8", weights="int8", attn_backend="numba")
    spy = Spy(llm)
    prompt = list(range(3, 60))  # two blocks of the pool
    fused = list(llm.generate_ids(prompt, 12, stop_at_eos=False))
    assert spy.calls == 11  # every decode step (the first token comes from the prefill)
    llm.fused_step = False
    try:
        assert list(llm.generate_ids(prompt, 12, stop_at_eos=False)) == fused
    finally:
        llm.fused_step = True
    assert spy.calls == 11


def assert_paged_steps_agree(llm, ids: list[int]) -> None:
    """Three decode steps after ``ids`` on a paged view whose two blocks lie in reverse order in the
    pool (logical block 0 in physical block 1), with the compiled steps and without: the same hidden
    states and the same pool contents (every store, sink stores and per-head parts included)."""
    cfg, mode = llm.config, llm.kv
    outs = []
    for fused in (True, False):
        per_token = kv_bytes_per_token(mode, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
        pool = BlockPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, mode, 8 * BLOCK * per_token)
        kv = PagedKV(pool)
        kv.blocks = pool.allocate(2)[::-1]
        llm.forward(ids, kv, 0)
        llm.fused_step = fused
        try:
            outs.append([llm.forward([5 + i], kv, len(ids) + i, prefill=False) for i in range(3)])
        finally:
            llm.fused_step = True
        stores = pool.k + pool.v + pool.k_sink + pool.v_sink
        outs[-1].append(torch.cat([p.data.flatten() for s in stores for p in getattr(s, "parts", [s])]))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("one_thread")
def test_paged_sequence_with_blocks_out_of_order(tiny_dirs):
    """A paged view whose blocks lie in reverse order in the pool: the fused step writes each layer's
    K/V at the block table's physical row and attends through the table, as the general path does."""
    llm = kvlens.load(tiny_dirs["llama"], kv="q8", weights="int4", attn_backend="numba")
    spy = Spy(llm)
    assert_paged_steps_agree(llm, list(range(3, 43)))
    assert spy.calls == 3


def per_head_recipe(keep_sink: int = 0):
    """A per-KV-head recipe of two layers (two KV heads): packed, 8-bit and f16 kinds per head (the
    tiny Llama's head_dim 16 takes no 4-bit kind: test_attend_step has those at head_dim 256)."""
    import dataclasses

    from kvlens.kv.modes import StoreKind
    from kvlens.kv.recipe import head_recipe_mode

    q8, q8h, q7h, q6h, q5h, f16 = (StoreKind(x) for x in ("q8", "q8h", "q7h", "q6h", "q5h", "f16"))
    mode = head_recipe_mode("r", [[(q8h, f16), (q7h, q5h)], [(q6h, q8), (q8, q6h)]])
    return dataclasses.replace(mode, keep_sink=keep_sink)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("keep_sink", [0, 3])
def test_layer_stored_per_head_runs_one_call_per_head(tiny_dirs, keep_sink):
    """A per-KV-head recipe (each KV head its own K and V kinds, a sink store or not): the whole-layer
    fused step does not apply (the stores are split per head); each layer's attention runs as one
    compiled call per KV head (kernels.attend_step), bit-identical to the general path, logits and
    stored rows, sink store included."""
    mode = per_head_recipe(keep_sink)
    llm = kvlens.load(tiny_dirs["llama"], kv=mode, attn_backend="numba")
    spy, per_head = Spy(llm), Spy(llm._attend_step.head_step)
    ids = list(range(3, 30))
    fused, c1 = decode_steps(llm, ids, mode, 3, True)
    assert spy.calls == 0 and per_head.calls == 3 * llm.config.n_layers * llm.config.n_kv_heads == 12
    plain, c2 = decode_steps(llm, ids, mode, 3, False)
    assert per_head.calls == 12
    assert all(torch.equal(a, b) for a, b in zip(fused, plain, strict=True))
    for s1, s2 in zip(c1.k + c1.v, c2.k + c2.v, strict=True):
        assert all(torch.equal(p1.data, p2.data) for p1, p2 in zip(s1.parts, s2.parts, strict=True))
    for s1, s2 in zip(c1.k_sink + c1.v_sink, c2.k_sink + c2.v_sink, strict=True):
        assert torch.equal(s1.data, s2.data)


@pytest.mark.usefixtures("one_thread")
def test_paged_per_head_recipe_with_a_sink_runs_one_call_per_head(tiny_dirs):
    """A per-KV-head recipe with a sink store in the serving pool, the sequence's blocks out of order:
    one compiled call per KV head writes at the block table's physical row, reads the sink rows of
    the sequence's block 0, and gives the general path's logits and pool contents bit for bit."""
    llm = kvlens.load(tiny_dirs["llama"], kv=per_head_recipe(keep_sink=3), attn_backend="numba")
    per_head = Spy(llm._attend_step.head_step)
    assert_paged_steps_agree(llm, list(range(3, 43)))
    assert per_head.calls == 3 * llm.config.n_layers * llm.config.n_kv_heads


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("kv", ["q6h", "k=q8h,v=q5h", "k=q7h,v=f16"])
def test_packed_kinds_run_the_fused_step(tiny_dirs, kv):
    """The packed N-bit kinds (q7h, q6h, q5h) are written by the fused step (step_kv.store_row, the
    general path's compiled packer) and read by its kernel: bit-identical logits and rows."""
    llm = kvlens.load(tiny_dirs["llama"], kv=kv, attn_backend="numba")
    assert_same_steps(llm, list(range(3, 30)), kv)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("kv", ["q6h", "k=q5h,v=q7h"])
def test_an_fp16_scale_out_of_range_is_refused_like_the_general_path(tiny_dirs, kv):
    """K values past fp16's range (a packed row's max_abs): the fused step
    stops with the general path's error and stores nothing of that layer."""
    llm = kvlens.load(tiny_dirs["llama"], kv=kv, attn_backend="numba")

    def spoil(norm: torch.Tensor) -> None:
        norm.mul_(1e6)

    runs = refusals_of_both_paths(llm, kv, list(range(3, 20)), spoil, ValueError, "fp16")
    assert runs[0][0] == runs[1][0]
    assert_layer_1_unstored(llm, runs)


def assert_layer_1_unstored(llm, runs: list[tuple]) -> None:
    """Layer 1's K and V stores, after each refused step of ``runs`` (:func:`refusals_of_both_paths`),
    hold what they held before it: nothing of the refused rows was stored."""
    n = llm.config.n_layers
    for _, cache, before in runs:
        after = [s.data for s in cache.k + cache.v]
        assert torch.equal(after[1], before[1]) and torch.equal(after[n + 1], before[n + 1])


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("backend, kv", [("numba", "q8"), ("numba-int16", "q8"), ("numba-int", "q4")])
def test_fused_and_general_paths_share_the_compiled_core(tmp_path, backend, kv):
    """The fused step calls the attention core the general path calls (cpu._decode_core, or
    cpu_int._core whose only compile-time argument is the CPU path), not a second specialization
    typed from literal flags, which every process would compile again (docs/testing.md)."""
    from numba import types

    from kvlens.kernels import cpu, cpu_int

    write_hf("llama", tmp_path, seed=7, hidden_size=256, num_attention_heads=4)  # head_dim 64: every kernel
    llm = kvlens.load(tmp_path, kv=kv, weights="f32", attn_backend=backend)
    assert_same_steps(llm, list(range(3, 40)), kv, steps=2)
    core, n_literal = (cpu._decode_core, 0) if backend == "numba" else (cpu_int._core, 1)
    assert core.overloads
    for sig in core.overloads:
        assert not any(isinstance(t, types.Literal) for t in sig[n_literal:]), sig

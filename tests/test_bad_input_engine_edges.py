"""Bad input found by the thirty-sixth session's hostile sweep at the engine's edges, each refused by
name before anything runs:

- an integer backend over a KV mode it cannot read (`generate --attn-backend numba-int --kv f32`
  echoed the prompt, then printed a traceback at the first step);
- a pool larger than the machine can allocate (torch's allocator error as "internal error");
- ``EngineConfig(prefix_cache="no")`` (read as true), ``run_alone(..., config="x")`` (AttributeError);
- a request too long for the context given to ``run_batch`` (its fitted pool was sized first: the
  allocator failed on 2**40 tokens instead of the request being named).
"""

from __future__ import annotations

import pytest
from test_bad_input_cli import assert_one_error_line, run_main

from kvlens.engine.attention import BackendError
from kvlens.engine.llm import ContextOverflowError
from kvlens.engine.scheduler import Engine, EngineConfig, Request, run_alone, run_batch
from kvlens.kv import stores as stores_module

TINY_MODEL = ("qwen3", 3)  # head_dim 32: the integer backends need a multiple of 32


@pytest.mark.parametrize(
    ("backend", "kv", "named"),
    [
        ("numba-int", "f32", "needs an int8 K cache"),
        ("numba-int", "q8-v", "needs an int8 K cache"),
        ("numba-int16", "f16", "needs an int8 K cache"),
        ("numba-int", "q6h", "cannot read q6h rows"),
        ("numba-int", "k=q8,v=q5h", "cannot read q5h rows"),
    ],
)
def test_an_engine_refuses_a_backend_that_cannot_read_its_cache(tiny, backend, kv, named):
    llm = tiny.variant(kv=kv, attn_backend=backend)
    with pytest.raises(BackendError, match=named):
        Engine(llm, EngineConfig(kv_budget_bytes=1 << 20))


def test_a_backend_that_reads_the_cache_is_taken(tiny):
    for kv in ("q8", "q8h", "q8+mirror"):
        Engine(tiny.variant(kv=kv, attn_backend="numba-int"), EngineConfig(kv_budget_bytes=1 << 20))


def test_generate_refuses_before_it_echoes_the_prompt(monkeypatch, capsys):
    code, out, err = run_main(
        monkeypatch, capsys, "generate", "--attn-backend", "numba-int", "--kv", "f32", "hi"
    )
    assert_one_error_line(code, out, err, "the numba-int backend needs an int8 K cache")


def test_a_pool_the_machine_cannot_allocate_is_named(tiny, monkeypatch):
    # The allocator's refusal is faked: whether a real one refuses a size depends on the machine.
    def refuse(*_args, **_kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(stores_module, "layer_stores", refuse)
    with pytest.raises(
        ValueError,
        match=r"cannot allocate a KV pool of 1048576 bytes \(kv_budget_bytes\): cannot allocate KV stores of "
        r"\d+ positions \(\d+ bytes\): DefaultCPU",
    ):
        Engine(tiny, EngineConfig(kv_budget_bytes=1 << 20))


def test_a_pool_past_the_kernels_position_limit_is_named(tiny):
    with pytest.raises(
        ValueError, match=r"a KV budget of 10{18} bytes is \d+ positions .* at most 2147483647"
    ):
        Engine(tiny, EngineConfig(kv_budget_bytes=10**18))


@pytest.mark.parametrize("name", ["prefix_cache", "keep_logits"])
def test_engine_flags_are_bools(name):
    with pytest.raises(TypeError, match=f"{name} must be True or False, got str 'no'"):
        EngineConfig(**{name: "no"})


def test_a_config_that_is_not_one_is_named(tiny):
    with pytest.raises(TypeError, match="config must be an EngineConfig, got str"):
        run_alone(tiny, Request("a", [5, 6], 2), config="x")


def test_a_request_too_long_is_named_before_a_pool_is_sized(tiny):
    with pytest.raises(ContextOverflowError, match=f"prompt 2 \\+ max_tokens {2**40} = "):
        run_batch(tiny, [Request("a", [5, 6], 2**40)])
    with pytest.raises(TypeError, match="max_tokens must be an integer"):
        run_alone(tiny, Request("a", [5, 6], "x"))


def test_a_head_the_backend_cannot_read_is_found_in_a_per_head_recipe(tiny):
    """Head 1 stores q5h K (packed) while the layer's widest K is q8h, which numba-int reads: the
    check must look at every head, not only each layer's widest pair."""
    from kvlens.kv.kinds import StoreKind
    from kvlens.kv.recipe import head_recipe_mode

    q8h, q5h = StoreKind.Q8H, StoreKind.Q5H
    mode = head_recipe_mode("per-head", [[(q8h, q8h), (q5h, q8h)]] * tiny.config.n_layers)
    assert mode.kinds(0) == (q8h, q8h)  # the premise: the widest pair hides the packed head
    with pytest.raises(BackendError, match="cannot read q5h rows"):
        Engine(tiny.variant(kv=mode, attn_backend="numba-int"), EngineConfig(kv_budget_bytes=1 << 20))

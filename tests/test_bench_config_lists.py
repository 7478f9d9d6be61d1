"""The bench configs built from Python: a list field given a bare string or number is refused with a
TypeError naming the field (a string of names is the CLI's comma list), never iterated letter by
letter (``kv="q8"`` read as modes ``q`` and ``8``) or left to fail mid-run."""

from __future__ import annotations

import pytest

from kvlens.bench.attention import AttentionBenchConfig
from kvlens.bench.decode import DecodeBenchConfig
from kvlens.bench.engine_decode import EngineBenchConfig
from kvlens.bench.serve import ServeBenchConfig

NAMES = [
    (AttentionBenchConfig, "shape"), (AttentionBenchConfig, "kv"), (DecodeBenchConfig, "kv"),
    (DecodeBenchConfig, "weights"), (DecodeBenchConfig, "attn_backend"), (EngineBenchConfig, "kv"),
    (ServeBenchConfig, "kv"), (ServeBenchConfig, "arms"),
]  # fmt: skip
SIZES = [
    (AttentionBenchConfig, "ctx"), (AttentionBenchConfig, "sparse_budget"), (DecodeBenchConfig, "ctx"),
    (EngineBenchConfig, "batches"), (ServeBenchConfig, "concurrency"),
]  # fmt: skip
VALID = {"shape": "smollm2", "kv": "f16", "weights": "auto", "attn_backend": "auto", "arms": "cache"}


@pytest.mark.parametrize(("cls", "field"), NAMES, ids=[f"{c.__name__}.{f}" for c, f in NAMES])
def test_names_take_a_list_or_a_comma_string_and_nothing_else(cls, field):
    one = VALID[field]
    assert getattr(cls(**{field: one}), field) == [one]
    assert getattr(cls(**{field: (one,)}), field) == [one]
    for bad in (7, None, [one, 7], {one: 1}):
        with pytest.raises(TypeError, match=f"^{field} must be a list of names"):
            cls(**{field: bad})


@pytest.mark.parametrize(("cls", "field"), SIZES, ids=[f"{c.__name__}.{f}" for c, f in SIZES])
def test_sizes_take_a_list_of_whole_numbers_and_nothing_else(cls, field):
    assert getattr(cls(**{field: (4, 8)}), field) == [4, 8]
    for bad in (4, "4", [4, 8.0], [True], "4,8"):
        with pytest.raises(TypeError, match=f"^{field} must be a list of whole numbers"):
            cls(**{field: bad})


def test_the_optional_lists_keep_none():
    cfg = AttentionBenchConfig(backend=None, sparse=None)
    assert (cfg.backend, cfg.sparse) == (None, None)
    assert AttentionBenchConfig(backend="numba,torch-sdpa").backend == ["numba", "torch-sdpa"]
    assert ServeBenchConfig(concurrency=None).concurrency == [1, 4, 8, 16]  # the documented default
    with pytest.raises(TypeError, match="^ctx must be"):
        AttentionBenchConfig(ctx=None)

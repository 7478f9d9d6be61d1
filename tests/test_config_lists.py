"""The bench and lab configs built from Python: a list field given a bare string or number is refused
with a TypeError naming the field (a string of names is the CLI's comma list), never iterated letter
by letter (``kv="q8"`` read as modes ``q`` and ``8``) or left to fail mid-run."""

from __future__ import annotations

import pytest

from kvlens.bench.attention import AttentionBenchConfig
from kvlens.bench.decode import DecodeBenchConfig
from kvlens.bench.engine_decode import EngineBenchConfig
from kvlens.bench.serve import ServeBenchConfig
from kvlens.lab.needle import NeedleConfig
from kvlens.lab.unit import UnitConfig

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


def _unit(**fields) -> UnitConfig:
    return UnitConfig(**fields)  # checked as it is built, as the other configs are


NUMBERS = [(NeedleConfig, "ctx", int), (NeedleConfig, "depth", float), (NeedleConfig, "sparse_budget", float),
           (_unit, "seq_len", int), (_unit, "amplitude", float)]  # fmt: skip


@pytest.mark.parametrize(("make", "field", "kind"), NUMBERS, ids=[f for _, f, _ in NUMBERS])
def test_the_lab_configs_number_lists(make, field, kind):
    good = [1, 0.5] if kind is float else [64, 256]
    extra = {"seq_len": [64]} if field == "amplitude" else {}
    assert getattr(make(**{field: tuple(good)}, **extra), field) == good
    what = "numbers" if kind is float else "whole numbers"
    for bad in (good[0], str(good[0]), [True]) + (([1.5],) if kind is int else ()):
        with pytest.raises(TypeError, match=f"^{field} must be a list of {what}, got"):
            make(**{field: bad}, **extra)

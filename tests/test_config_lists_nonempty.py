"""A list field names what a run compares: empty, the run compared nothing and exited 0 with an empty
table (``bench decode --kv ''`` was an IndexError), and a value given twice ran twice (thirty-sixth
session's sweep). Both are refused naming the field and its CLI option; the lists that may be empty
(no sparse variants, no needle budgets, no arms beside llama-server) stay so."""

from __future__ import annotations

import pytest
from test_config_lists import NAMES, SIZES, VALID

from kvlens.bench.attention import AttentionBenchConfig
from kvlens.bench.decode import DecodeBenchConfig
from kvlens.bench.serve import ServeBenchConfig
from kvlens.lab.needle import NeedleConfig

ALL = (
    NAMES
    + [(c, f) for c, f in SIZES if f != "concurrency"]
    + [(NeedleConfig, "ctx"), (NeedleConfig, "depth")]
)
EMPTY = [(c, f) for c, f in ALL if f != "arms"]  # arms matter to multiturn alone (the rule below)
TWICE = {**VALID, "ctx": 64, "sparse_budget": 64, "batches": 4, "depth": 0.5}


@pytest.mark.parametrize(("cls", "field"), EMPTY, ids=[f"{c.__name__}.{f}" for c, f in EMPTY])
def test_an_empty_list_is_refused_by_name(cls, field):
    empties = [[], ""] if field in VALID else [[]]  # a name list from the CLI: the empty comma string
    for empty in empties:
        with pytest.raises(
            ValueError, match=rf"^{field} \(--{field.replace('_', '-')}\) is empty: give at least one value"
        ):
            cls(**{field: empty})


@pytest.mark.parametrize(("cls", "field"), ALL, ids=[f"{c.__name__}.{f}" for c, f in ALL])
def test_a_value_given_twice_is_refused_by_name(cls, field):
    value = TWICE[field]
    with pytest.raises(ValueError, match=rf"^{field} \(--{field.replace('_', '-')}\) gives {value!r} twice"):
        cls(**{field: [value, value]})


def test_the_lists_that_may_be_empty_stay_so():
    assert AttentionBenchConfig(sparse=[]).sparse == []
    assert NeedleConfig(sparse_budget=[]).sparse_budget == []
    assert ServeBenchConfig(scenario="multiturn", arms=[], vs_llama_server="/bin/true").arms == []
    with pytest.raises(ValueError, match="give at least one arm, or --vs-llama-server"):
        ServeBenchConfig(scenario="multiturn", arms=[])


def test_a_decode_bench_whose_backends_read_none_of_its_modes_is_refused():
    with pytest.raises(ValueError, match="no --attn-backend of numba-int reads any --kv mode of f32,f16"):
        DecodeBenchConfig(kv=["f32", "f16"], attn_backend=["numba-int"])
    DecodeBenchConfig(kv=["f32", "q8"], attn_backend=["numba-int"])  # q8 runs: f32 is skipped, as before

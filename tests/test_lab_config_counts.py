"""The lab configs built from Python check their counts and mode lists by name (thirty-sixth session's
sweep: `PplConfig(prefill_chunk="8")` failed with "'<' not supported between 'str' and 'int'",
`ctx=8.5` with "slice indices must be integers", `GreedyConfig(tokens=2.5)` blamed a cache's
capacity, and `PplConfig(kv=[])` ran and returned no rows)."""

from __future__ import annotations

import pytest

from kvlens.lab.greedy import GreedyConfig
from kvlens.lab.layers import LayersConfig
from kvlens.lab.ppl import PplConfig

CASES = [
    (PplConfig, {"prefill_chunk": "8"}, TypeError, "--prefill-chunk must be an integer, got str '8'"),
    (PplConfig, {"ctx": 8.5}, TypeError, "--ctx must be an integer, got float 8.5"),
    (PplConfig, {"ctx": 3}, ValueError, "--ctx must be ≥ 4, got 3"),
    (PplConfig, {"chunks": 1.5}, TypeError, "--chunks must be an integer"),
    (PplConfig, {"chunks": 0}, ValueError, "--chunks must be ≥ 1"),
    (PplConfig, {"keep_sink": -1}, ValueError, "keep_sink"),  # CacheOptions' own check
    (PplConfig, {"kv": []}, ValueError, "no KV mode given"),
    (PplConfig, {"kv": 8}, TypeError, "kv must be a comma list or a list of modes, got int"),
    (GreedyConfig, {"tokens": "3"}, TypeError, "--tokens must be an integer, got str '3'"),
    (GreedyConfig, {"tokens": 2.5}, TypeError, "--tokens must be an integer, got float 2.5"),
    (GreedyConfig, {"prompts": 0}, ValueError, "--prompts must be ≥ 1"),
    (GreedyConfig, {"show": -1}, ValueError, "--show must be ≥ 0"),
    (LayersConfig, {"ctx": 3}, ValueError, "--ctx must be ≥ 4, got 3"),  # the CLI's floor
    (LayersConfig, {"chunks": 1.0}, TypeError, "--chunks must be an integer"),
]


@pytest.mark.parametrize(("cls", "changes", "error", "said"), CASES, ids=[str(c[1]) for c in CASES])
def test_a_count_or_mode_list_is_named(cls, changes, error, said):
    with pytest.raises(error, match=said):
        cls(**changes)


def test_the_defaults_and_numpy_integers_are_taken():
    import numpy as np

    PplConfig(ctx=np.int64(64), chunks=np.int64(2))
    GreedyConfig(show=0)
    LayersConfig()

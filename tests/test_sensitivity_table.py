"""The plan's sensitivity table, whole: per layer or per KV head as asked (every item of the model and
each kind, no other key), each entry the KLD of a full engine pass over that item's probe, and one
progress line per layer on stderr."""

from __future__ import annotations

import itertools

import pytest
from test_sensitivity import engine_kld

from kvlens.kv.modes import StoreKind
from kvlens.lab.sensitivity import Sensitivity, probe_mode

Q4H, Q8H = StoreKind.Q4H, StoreKind.Q8H
TINY_MODEL = ("qwen3", 7)  # conftest's tiny: 2 layers, 2 KV heads, head_dim 32
CTX = 48


@pytest.mark.parametrize("per_head", [False, True])
def test_the_table_has_an_entry_per_item_and_kind(tiny, per_head):
    sens = Sensitivity(tiny, [list(range(3, 3 + CTX))], CTX)
    heads = [(h,) for h in range(2)] if per_head else [()]
    want = {
        (layer, *head, role, kind)
        for layer, head, role, kind in itertools.product(range(2), heads, "kv", [Q4H, Q8H])
    }
    assert set(sens.table([Q4H, Q8H], per_head)) == want


def test_a_per_head_entry_is_its_probes_engine_kld(tiny):
    chunk = list(range(3, 3 + CTX))
    table = Sensitivity(tiny, [chunk], CTX).table([Q4H], per_head=True)
    for item in [(1, 0, "v"), (0, 1, "k")]:
        expected = engine_kld(tiny, [chunk], probe_mode(2, 2, item, Q4H), CTX)
        assert table[(*item, Q4H)] == pytest.approx(expected, rel=1e-3, abs=1e-9)


@pytest.mark.parametrize("per_head", [False, True])
def test_one_progress_line_per_layer(tiny, per_head, capsys):
    Sensitivity(tiny, [list(range(3, 3 + CTX))], CTX).table([Q4H], per_head)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "sensitivity:" in line]
    assert lines == ["  sensitivity: layer 1/2", "  sensitivity: layer 2/2"]

"""``lab unit``'s printed output (kvlens.lab.unit_output): the mean ± std cells, and the kernel's own
error shown wherever ``--attn-backend`` measured it."""

from __future__ import annotations

import json

from rich.console import Console

from kvlens.lab import unit
from kvlens.lab.unit import UnitConfig
from kvlens.lab.unit_output import _fmt, render, to_json


def test_cells_show_the_spread_from_two_trials_on():
    p = {"trials": 2, "std": {"signed_t": 0.5, "cosine": 1e-4}, "signed_t": -2.0, "cosine": 0.999}
    assert _fmt(p, "signed_t") == "-2 ± 0.5"
    assert _fmt(p, "signed_t", short=True) == "-2 ±25%"  # the spread as a share of |mean|
    assert _fmt(p, "cosine") == "0.999000 ± 0.0001"
    assert _fmt(p | {"trials": 1}, "signed_t") == "-2"
    assert _fmt(p | {"signed_t": 0.0}, "signed_t", short=True) == "0"


def _printed(result) -> str:
    con = Console(record=True, width=400)
    render(result, con)
    return con.export_text()


def test_the_kernel_error_is_shown_for_a_point_and_a_sweep():
    cfg = dict(head_dim=64, heads=2, kv_heads=1, trials=2, attn_backend="numba")
    point = unit.run(UnitConfig(seq_len=[48], **cfg))
    text = _printed(point)
    assert "rel L2 numba vs reference, same K/V" in text and " ± " in text
    assert "kernel_rel_l2" in json.loads(to_json(point))
    sweep = unit.run(UnitConfig(seq_len=[32, 48], **cfg))
    text = _printed(sweep)
    assert "kernel rel L2" in text and "attention numba" in text
    assert len(json.loads(to_json(sweep))) == 2
    plain = _printed(unit.run(UnitConfig(seq_len=[32, 48], head_dim=64)))
    assert "kernel rel L2" not in plain

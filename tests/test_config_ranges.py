"""Every command's config dataclass refuses what its CLI options refuse at parse time, when it is built
from Python: each integer option's declared range (typer's ``min`` / ``max``, read from the CLI
itself, so a range added there is checked here too), each size list's items (the CLI's size lists
are ≥ 1) and each finite-float option. The boundary itself is taken: a config no stricter than its CLI.
Before, e.g. ``DecodeBenchConfig(steps=-1)`` or ``UnitConfig(trials=0)`` ran."""

from __future__ import annotations

import dataclasses
import math

import pytest
import typer

from kvlens.bench.attention import AttentionBenchConfig
from kvlens.bench.decode import DecodeBenchConfig
from kvlens.bench.engine_decode import EngineBenchConfig
from kvlens.bench.serve import ServeBenchConfig
from kvlens.cli import app
from kvlens.engine.generate import GenerateConfig
from kvlens.lab.doctor import DoctorConfig
from kvlens.lab.greedy import GreedyConfig
from kvlens.lab.layers import LayersConfig
from kvlens.lab.needle import NeedleConfig
from kvlens.lab.plan import PlanConfig
from kvlens.lab.ppl import PplConfig
from kvlens.lab.unit import UnitConfig
from kvlens.serve.cli import ServeConfig

# the config each command builds (config_from in kvlens/cli*.py), and what it needs besides defaults
CONFIGS = {
    "generate": (GenerateConfig, {"prompt": "hi"}),
    "serve": (ServeConfig, {}),
    "lab unit": (UnitConfig, {}),
    "lab ppl": (PplConfig, {}),
    "lab greedy": (GreedyConfig, {}),
    "lab layers": (LayersConfig, {}),
    "lab plan": (PlanConfig, {}),
    "lab doctor": (DoctorConfig, {}),
    "lab needle": (NeedleConfig, {}),
    "bench attention": (AttentionBenchConfig, {}),
    "bench decode": (DecodeBenchConfig, {}),
    "bench engine": (EngineBenchConfig, {}),
    "bench serve": (ServeBenchConfig, {}),
}
# size lists (the CLI's sizes_option: items ≥ 1) and finite floats (finite_option), by config
SIZE_LISTS = {
    UnitConfig: ["seq_len"],
    NeedleConfig: ["ctx"],
    AttentionBenchConfig: ["ctx", "sparse_budget"],
    DecodeBenchConfig: ["ctx"],
    EngineBenchConfig: ["batches"],
}
FINITE = {
    GenerateConfig: ["temperature", "top_p"],
    ServeConfig: ["graceful_s"],
    UnitConfig: ["k_amp", "v_amp"],
    AttentionBenchConfig: ["mem_gib"],
}

# a config's own floor below its option's, on purpose (and why)
WIDER = {("lab plan", "heldout_chunks"): 0}  # the doctor plans with no held-out chunks


def _commands(cmd, path=()):
    subs = getattr(cmd, "commands", None)
    if subs:
        for name, sub in subs.items():
            yield from _commands(sub, (*path, name))
    else:
        yield " ".join(path), cmd


def ranged_options() -> list[tuple[str, str, int | None, int | None]]:
    out = []
    for path, cmd in _commands(typer.main.get_command(app)):
        if path not in CONFIGS:
            continue
        fields = {f.name for f in dataclasses.fields(CONFIGS[path][0])}
        for p in cmd.params:
            lo, hi = getattr(p, "min", None), getattr(p, "max", None)
            if (lo is not None or hi is not None) and p.name in fields:
                out.append((path, p.name, WIDER.get((path, p.name), lo), hi))
    return out


RANGED = ranged_options()


def test_the_cli_declares_ranges_for_these_configs():
    """Premise: the walk over the CLI finds the ranged options (a typer change would empty it)."""
    assert {path for path, *_ in RANGED} >= {"serve", "lab unit", "lab ppl", "bench decode", "bench serve"}
    assert len(RANGED) >= 40


@pytest.mark.parametrize(("path", "name", "lo", "hi"), RANGED, ids=[f"{p}:{n}" for p, n, *_ in RANGED])
def test_a_config_refuses_what_its_option_refuses(path, name, lo, hi):
    cls, needs = CONFIGS[path]
    for outside in ([lo - 1] if lo is not None else []) + ([hi + 1] if hi is not None else []):
        with pytest.raises((ValueError, TypeError), match=name.replace("_", "[-_]")):
            cls(**needs, **{name: outside})
    for edge in [v for v in (lo, hi) if v is not None]:
        cls(**needs, **{name: edge})


@pytest.mark.parametrize(
    ("cls", "name"),
    [(c, n) for c, names in SIZE_LISTS.items() for n in names],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_a_size_list_refuses_an_item_under_one(cls, name):
    for bad in ([0], [-4], [1, 0]):
        with pytest.raises(ValueError, match=name.replace("_", "[-_]")):
            cls(**{name: bad})


@pytest.mark.parametrize(
    ("cls", "name"),
    [(c, n) for c, names in FINITE.items() for n in names],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_a_float_option_refuses_nan_and_inf(cls, name):
    needs = {"prompt": "hi"} if cls is GenerateConfig else {}
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match=name.replace("_", "[-_]")):
            cls(**needs, **{name: bad})

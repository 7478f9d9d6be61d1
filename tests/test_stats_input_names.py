"""Every per-token array the statistics take is checked, and the refusal names it: for each argument
of ``ppl_stats``, ``kld_stats``, ``dp_stats`` and ``summarize`` (all three blocks), a NaN or an empty
array is refused by its own name, and an array of one token beside arrays of four (which numpy would
broadcast, or ``kld_stats`` would take alone) is refused as a length mismatch."""

from __future__ import annotations

import pytest

from kvlens.lab.stats import dp_stats, kld_stats, ppl_stats, summarize

GOOD = {"nll_q": [1.0, 2.0, 3.0, 4.0], "nll_base": [1.0, 1.0, 2.0, 2.0], "kld": [0.1, 0.2, 0.3, 0.4],
        "p_q": [0.5, 0.25, 0.5, 0.75], "p_base": [0.25, 0.25, 0.5, 0.5], "top_q": [1, 2, 3, 4],
        "top_base": [1, 2, 4, 4]}  # fmt: skip
CALLS = [
    (ppl_stats, ["nll_q", "nll_base"]),
    (kld_stats, ["kld"]),
    (dp_stats, ["p_q", "p_base", "top_q", "top_base"]),
    (summarize, ["nll_q", "nll_base", "kld", "top_q", "top_base"]),
]
CASES = [(fn, names, name) for fn, names in CALLS for name in names]
IDS = [f"{fn.__name__}-{name}" for fn, _, name in CASES]
PAIRED = [c for c in CASES if len(c[1]) > 1]
PAIRED_IDS = [f"{fn.__name__}-{name}" for fn, _, name in PAIRED]


def call(fn, names: list[str], **override):
    return fn(*[override.get(name, GOOD[name]) for name in names])


@pytest.mark.parametrize(("fn", "names", "name"), CASES, ids=IDS)
def test_a_nan_is_refused_by_the_arrays_name(fn, names, name):
    bad = list(GOOD[name])
    bad[2] = float("nan")
    with pytest.raises(ValueError, match=f"^{name} has a non-finite value at index 2 "):
        call(fn, names, **{name: bad})


@pytest.mark.parametrize(("fn", "names", "name"), CASES, ids=IDS)
def test_an_empty_array_is_refused_by_its_name(fn, names, name):
    with pytest.raises(ValueError, match=f"^{name} is empty$"):
        call(fn, names, **{name: []})


@pytest.mark.parametrize(("fn", "names", "name"), PAIRED, ids=PAIRED_IDS)
def test_one_token_beside_four_is_a_length_mismatch(fn, names, name):
    with pytest.raises(ValueError, match=f"per-token arrays differ in length: .*'{name}': 1"):
        call(fn, names, **{name: GOOD[name][:1]})

"""``lab plan``'s choice and budget search where the earlier tests did not reach: per-KV-head items
count an int8 K row's code sums as per-layer ones do; the greedy choice is maximal at any KLD scale
(also where an item's KLD exceeds the bytes it saves); the search is scale-free (a budget of 2e-3,
the default's size, steps as a budget of 1 does), aims at budget / measured once within, and stops on a
choice that measures exactly zero."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvlens.kv.modes import StoreKind
from kvlens.lab.recipe_search import SEARCH_ROUNDS, Checked, choose, search_working_budget

F16, Q8H, Q4H = StoreKind.F16, StoreKind.Q8H, StoreKind.Q4H
HD = 64


def test_a_per_head_k_row_counts_its_code_sums():
    """As ``test_recipe``'s per-layer case: at head_dim 64 q8h saves 60 bytes of a V row and 56 of a K
    row (its int16 sums), so V at 0.26 (60 / 0.26 = 231) beats K at 0.25 (56 / 0.25 = 224)."""
    sens = {(0, 0, "k", Q8H): 0.25, (0, 0, "v", Q8H): 0.26}
    chosen, predicted = choose(sens, HD, 0.375)
    assert chosen == {(0, 0, "k"): F16, (0, 0, "v"): Q8H} and predicted == 0.26


def row_bytes(item: tuple, kind: StoreKind) -> int:
    return kind.row_bytes(HD, with_ksum=item[-1] == "k")


@given(
    per_head=st.booleans(),
    exponents=st.lists(st.tuples(st.floats(-9, 3), st.floats(0, 2)), min_size=1, max_size=6),
    budget_exp=st.floats(-9, 4),
)
@example(per_head=False, exponents=[(2.7, 0.0)], budget_exp=3.0)  # KLD 500 for 60 bytes saved
def test_the_choice_is_within_budget_and_maximal_at_any_scale(per_head, exponents, budget_exp):
    """Within the budget, and no single move to a kind of fewer bytes fits in what is left: KLDs from
    1e-9 to ~1e5, so some items cost more KLD than the bytes they save."""
    sens = {}
    for i, (q8_exp, q4_extra) in enumerate(exponents):
        item = (i // 2, 0, "kv"[i % 2]) if per_head else (i // 2, "kv"[i % 2])
        sens[(*item, Q8H)] = 10.0**q8_exp
        sens[(*item, Q4H)] = 10.0 ** (q8_exp + q4_extra)
    budget = 10.0**budget_exp
    chosen, predicted = choose(sens, HD, budget)
    kld = {item: 0.0 if kind == F16 else sens[(*item, kind)] for item, kind in chosen.items()}
    total = sum(kld.values())
    assert total <= budget * (1 + 1e-12) and total == pytest.approx(predicted, rel=1e-9)
    for item, kind in chosen.items():
        for cheaper in (Q8H, Q4H):
            if row_bytes(item, cheaper) < row_bytes(item, kind):
                assert total - kld[item] + sens[(*item, cheaper)] > budget, (item, kind, cheaper)


def scripted(measured: list[float], scale: float = 1.0):
    """A check that replies ``measured`` in turn, with bytes falling as the working budget grows."""
    replies, calls = iter(measured), []

    def check(w: float) -> Checked:
        calls.append(w)
        return Checked(f"recipe@{w:.9f}", w, next(replies) * scale, round(10_000 - 1_000 * w / scale))

    return check, calls


@pytest.mark.parametrize("scale", [1.0, 2e-3, 50.0])
def test_the_search_steps_alike_at_any_budget_scale(scale):
    """``test_recipe``'s bracket case with budget and measurements scaled together: the working
    budgets scale with them, and the 2 % bracket stops it at the same step."""
    check, calls = scripted([1.01, 0.99, 1.001, 0.99, 0.99, 0.99], scale)
    got, rounds = search_working_budget(check, scale)
    w2 = 1.0 / 1.01 * 0.9
    w3 = (w2 + 1.0) / 2
    w4 = (w2 + w3) / 2
    w5 = (w4 + w3) / 2
    assert rounds == 5 and calls == pytest.approx([scale * w for w in (1.0, w2, w3, w4, w5)], rel=1e-12)
    assert got.predicted == pytest.approx(scale * w5, rel=1e-12)


def test_within_at_first_the_search_aims_at_budget_over_measured():
    """Measured 0.5 of a budget of 1 at w = 1: the next working budget is 1 / 0.5 = 2 (the 10 % cut
    applies only while over)."""
    check, calls = scripted([0.5, 2.0, 0.9, 0.9, 0.9, 0.9])
    search_working_budget(check, 1.0)
    assert calls[:2] == [1.0, 2.0]


def test_a_choice_measuring_exactly_zero_ends_the_search():
    """Nothing fits (every item stays f16): its KLD is exactly 0, and there is nothing to scale by."""
    check, calls = scripted([0.0] * SEARCH_ROUNDS)
    got, rounds = search_working_budget(check, 1e-3)
    assert rounds == 1 and calls == [1e-3] and got.measured == 0.0

"""The choice step of ``kvlens lab plan`` (:mod:`.plan`): a greedy multiple-choice knapsack over the
items' measured KLDs (:func:`choose`), and the search of the working budget that makes the choice's
KLD, measured on the calibration chunks, land within the budget (:func:`search_working_budget`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..kv.modes import KVMode, StoreKind
from ..kv.recipe import head_recipe_mode
from .sensitivity import ROLES, Item, Sensitivity

F16 = StoreKind.F16
SEARCH_ROUNDS = 6  # calibration checks of a choice while the working budget is searched
BRACKET = 0.02  # stop when the bracket is this share of the working budget


def choose(sens: dict[tuple, float], head_dim: int, budget: float) -> tuple[dict[Item, StoreKind], float]:
    """The greedy choice under ``budget`` (sum of the items' KLDs): a kind per item and the predicted
    KLD. ``sens`` maps ``(*item, kind)`` to the item's KLD in that kind; items (a layer's K or V, or
    one KV head's) share one granularity, so their bytes compare as one row's."""
    kinds = sorted({key[-1] for key in sens}, key=lambda k: -k.row_bytes(head_dim))
    choice: dict[Item, StoreKind] = {key[:-1]: F16 for key in sens}

    def cost(item, kind):
        return 0.0 if kind == F16 else sens[(*item, kind)]

    def row_bytes(item, kind):  # what the store holds: an int8 K row keeps its code sums too
        return kind.row_bytes(head_dim, with_ksum=item[-1] == "k")

    total = 0.0
    while True:
        best, best_ratio = None, -1.0
        for item, cur in choice.items():
            for kind in kinds:
                saved = row_bytes(item, cur) - row_bytes(item, kind)
                added = cost(item, kind) - cost(item, cur)
                if saved <= 0 or total + added > budget:
                    continue
                ratio = saved / max(added, 1e-15)
                if ratio > best_ratio:
                    best, best_ratio = (item, kind, added), ratio
        if best is None:
            break
        item, kind, added = best
        choice[item] = kind
        total += added
    return choice, total


def choice_mode(name: str, choice: dict[Item, StoreKind], n_layers: int, n_kv: int) -> KVMode:
    """The recipe of a choice over (layer, role) or (layer, head, role) items (unlisted: f16)."""
    layers = [[[F16, F16] for _ in range(n_kv)] for _ in range(n_layers)]
    for item, kind in choice.items():
        heads = range(n_kv) if len(item) == 2 else [item[1]]
        for h in heads:
            layers[item[0]][h][ROLES.index(item[-1])] = kind
    return head_recipe_mode(name, [[(k, v) for k, v in heads] for heads in layers])


@dataclass(frozen=True)
class Checked:
    """One calibration check of a choice: the recipe, its predicted and measured KLD, its bytes."""

    recipe: Any
    predicted: float
    measured: float
    bytes_per_token: int


def search_working_budget(check: Callable[[float], Checked], budget: float) -> tuple[Checked, int]:
    """The fewest bytes measured within ``budget``: ``check(working)`` chooses under a working budget
    (the sum of the items' KLDs) and measures the choice. The items' KLDs do not add exactly, so the
    working budget is searched: scaled by budget / measured (0.9 of it while over) until one check is
    within and one over, then bisected between the largest within and the smallest over, at most
    :data:`SEARCH_ROUNDS` checks. Returns (the best check within, or the last one if none was;
    the number of checks)."""
    working, within, over = budget, 0.0, math.inf
    best = last = None
    rounds = 0
    while rounds < SEARCH_ROUNDS:
        rounds += 1
        prev, last = last, check(working)
        if last.measured <= budget:
            within = max(within, working)
            if best is None or last.bytes_per_token < best.bytes_per_token:
                best = last
        else:
            over = min(over, working)
        if over < math.inf and within > 0:  # bracketed: bisect
            if over - within <= BRACKET * over:
                break
            working = (within + over) / 2
        elif prev is not None and last.bytes_per_token == prev.bytes_per_token or last.measured <= 0:
            break  # grown, and the choice did not move (every item at its cheapest kind)
        else:  # aim at the budget by the measured / predicted mismatch; overshoot down by 10 %
            working *= budget / last.measured * (0.9 if last.measured > budget else 1.0)
    return best or last, rounds


def choose_verified(
    sens: Sensitivity, table: dict[tuple, float], budget: float, name: str
) -> tuple[KVMode, float, float, int]:
    """The recipe of the fewest bytes whose KLD measured on the calibration chunks is within
    ``budget`` (:func:`search_working_budget`). (recipe, predicted, measured, checks)."""
    c = sens.llm.config

    def check(working: float) -> Checked:
        choice, predicted = choose(table, c.head_dim, working)
        recipe = sens.centered(choice_mode(name, choice, c.n_layers, c.n_kv_heads))
        bytes_per_token = recipe.bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim)
        return Checked(recipe, predicted, sens.kld(recipe), bytes_per_token)

    got, rounds = search_working_budget(check, budget)
    return got.recipe, got.predicted, got.measured, rounds

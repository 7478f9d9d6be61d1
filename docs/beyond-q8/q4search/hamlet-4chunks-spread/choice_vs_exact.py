"""Does lab plan's greedy choice leave bytes on the table? On a plan's stored sensitivity table, the
greedy choice (kvlens.lab.recipe_search.choose) against the exact optimum of the same problem (fewest
bytes with the items' KLDs summing within a working budget), bracketed by two dynamic programs over
the KLD in budget/20000 steps: each item's KLD rounded up (every answer truly fits: an upper bound
on the optimum's bytes) and rounded down (a relaxation: a lower bound).
Usage: python choice_vs_exact.py plan.json [head_dim]"""

import json
import math
import sys

import numpy as np

from kvlens.kv.modes import StoreKind
from kvlens.lab.recipe_search import choose

F16 = StoreKind.F16


def load_table(path: str) -> dict[tuple, float]:
    sens = {}
    for key, value in json.load(open(path))["sensitivity"].items():
        *item, kind = key.split(".")
        sens[(*(int(p) if p.isdigit() else p for p in item), StoreKind(kind))] = value
    return sens


def exact_bytes(sens: dict, hd: int, budget: float, up: bool, steps: int = 20000) -> int:
    items = sorted({k[:-1] for k in sens})
    kinds = sorted({k[-1] for k in sens}, key=lambda k: -k.row_bytes(hd))
    unit = budget / steps
    best = np.full(steps + 1, np.inf)
    best[0] = 0.0
    for item in items:
        ksum = item[-1] == "k"
        options = [(F16.row_bytes(hd, with_ksum=ksum), 0)] + [
            (k.row_bytes(hd, with_ksum=ksum), (math.ceil if up else math.floor)(sens[(*item, k)] / unit))
            for k in kinds
        ]
        nxt = np.full(steps + 1, np.inf)
        for nbytes, w in options:
            if w <= steps:
                nxt[w:] = np.minimum(nxt[w:], best[: steps + 1 - w] + nbytes)
        best = nxt
    return int(best.min())


def main() -> None:
    sens = load_table(sys.argv[1])
    hd = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    print(
        "| working budget | greedy bytes/token | its predicted KLD | optimum bytes/token within |\n|---|---|---|---|"
    )
    for budget in (0.0006, 0.0007, 0.000736, 0.0008, 0.0009):
        choice, predicted = choose(sens, hd, budget)
        greedy = sum(k.row_bytes(hd, with_ksum=item[-1] == "k") for item, k in choice.items())
        low, high = (exact_bytes(sens, hd, budget, up) for up in (False, True))
        print(f"| {budget:g} | {greedy} | {predicted:.6f} | {low}–{high} |")


if __name__ == "__main__":
    main()

"""Does q4h's search tell C's round-half-to-even from half-up? (planted bug ``q4h-round-half-up``)

Runs the torch rule (``kv.quant.quantize_q4_search_blocks``) as it is and with ``torch.round``
replaced by ``floor(x + 0.5)`` on 17,000 random blocks of half-integers (exact ties at the first
candidate's scale, the block's max at +-8) and prints every block where the two differ in codes or
fp16 step. Run from the repository root: ``.venv/bin/python docs/testing/planted-kvquant29/q4h_ties.py``.
"""

import numpy as np
import torch

from kvlens.kv import quant


def half_up(xg: torch.Tensor):
    orig = torch.round
    try:
        torch.round = lambda t: torch.floor(t + 0.5)
        return quant.quantize_q4_search_blocks(xg)
    finally:
        torch.round = orig


def differs(x: np.ndarray) -> bool:
    xt = torch.from_numpy(x)[None]
    (a, da), (b, db) = quant.quantize_q4_search_blocks(xt), half_up(xt)
    return not (torch.equal(a, b) and torch.equal(da.view(torch.int16), db.view(torch.int16)))


gen = np.random.default_rng(0)
tried = found = 0
for trial in range(2000):
    x = (gen.integers(-8, 8, 32) + 0.5).astype(np.float32)
    x[gen.integers(32)] = -8.0
    tried += 1
    if differs(x):
        found += 1
        print(x.tolist())
for lo, hi in [(-2, 2), (-4, 4), (0, 8), (-8, 0), (-1, 1)]:
    for trial in range(3000):
        x = (gen.integers(lo, hi, 32) + 0.5).astype(np.float32)
        n = gen.integers(1, 32)
        x[gen.permutation(32)[:n]] = gen.choice([0.0, 1.0, -1.0, 2.0, 7.0, -7.0], n)
        x[gen.integers(32)] = gen.choice([-8.0, 8.0])
        tried += 1
        if differs(x):
            found += 1
            print(x.tolist())
print(f"{tried} blocks tried, {found} where half-up rounding changes the stored codes or step")

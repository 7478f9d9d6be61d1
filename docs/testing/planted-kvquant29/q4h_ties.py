"""Can q4h's search tell its two surviving planted bugs from the rule? ``q4h-round-half-up``: C's
round-half-to-even replaced by half up; ``q4h-last-of-equals``: the last of equal gains chosen
instead of the first.

Runs the torch rule (``kv.quant.quantize_q4_search_blocks``) as it is and with each change, on
17,000 random blocks of half-integers (exact ties at the first candidate's scale, the block's max
at +-8) and 200 blocks built for equal gains (codes -8, -8 at the first candidate's scale and -7, -7
at the 7.1-7.4 ones, small values that move one code at each later candidate), and prints every
block where a change alters the codes or fp16 step. Run from the repository root: ``.venv/bin/python docs/testing/planted-kvquant29/q4h_ties.py``.
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


def last_of_equals(xg: torch.Tensor):
    orig = torch.Tensor.argmax

    def argmax(self, dim=None, keepdim=False):
        if dim == -1 and self.dtype == torch.float64:  # the gains: the last of equals
            return self.shape[-1] - 1 - orig(self.flip(-1), dim=dim, keepdim=keepdim)
        return orig(self, dim=dim, keepdim=keepdim)

    try:
        torch.Tensor.argmax = argmax
        return quant.quantize_q4_search_blocks(xg)
    finally:
        torch.Tensor.argmax = orig


def differs(x: np.ndarray) -> bool:
    xt = torch.from_numpy(x)[None]
    a, da = quant.quantize_q4_search_blocks(xt)
    for changed in (half_up, last_of_equals):
        b, db = changed(xt)
        if not (torch.equal(a, b) and torch.equal(da.view(torch.int16), db.view(torch.int16))):
            print(changed.__name__, end=": ")
            return True
    return False


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
for big in np.linspace(0.9375, 0.95, 200):
    x = np.zeros(32, np.float32)
    x[0], x[1] = 1.0, big
    x[2:11] = [0.5 / (8.05 + 0.1 * k) for k in range(9)]
    tried += 1
    if differs(x):
        found += 1
        print(x.tolist())
print(f"{tried} blocks tried, {found} where either change alters the stored codes or step")

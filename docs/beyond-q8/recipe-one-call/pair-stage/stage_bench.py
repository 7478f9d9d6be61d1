"""The fused CPU kernel's staging alone (kernels.stage._stage: one KV head's 4096 rows in tiles of 32,
hot, one thread): µs per 4096 rows and ns per value for q8 and the packed kinds at head_dim 64 and
256, random bytes. Best mean of 7 rounds of 20 passes.

    python docs/beyond-q8/recipe-one-call/pair-stage/stage_bench.py
"""

import time

import numpy as np
from numba import njit

from kvlens.kernels.stage import CODE_PACKED, CODE_Q8, _stage

N = 4096


@njit(cache=False)
def stage_all(raw, code, bsc, n, tile_u, tile, bs_u, bs_f):  # pragma: no cover - compiled
    acc = np.float32(0.0)
    for t0 in range(0, n, 32):
        _stage(raw, code, bsc, 0, t0, 32, tile_u, tile, bs_u, bs_f)
        acc += tile[5, 7]
    return acc


def main() -> None:
    rng = np.random.default_rng(0)
    for hd in (64, 256):
        kinds = [("q8", CODE_Q8, hd)] + [(f"q{b}h", CODE_PACKED + b, hd * b // 8) for b in (7, 6, 5)]
        for name, code, width in kinds:
            raw = rng.integers(0, 256, size=(1, N, width), dtype=np.uint8)
            bsc = np.full((1, N, 1), 0x3C00, np.uint16)
            tile = np.zeros((32, hd), np.float32)
            scratch = np.zeros(32 * max(hd // 32, 1) + 1, np.uint32)
            args = (raw, code, bsc, N, tile.view(np.uint32), tile, scratch, scratch.view(np.float32))
            stage_all(*args)
            best = 1e9
            for _ in range(7):
                t = time.perf_counter()
                for _ in range(20):
                    stage_all(*args)
                best = min(best, (time.perf_counter() - t) / 20)
            print(
                f"hd {hd:3d} {name}: {best * 1e6:7.1f} µs per {N} rows ({best * 1e9 / (N * hd):.3f} ns/value)"
            )


if __name__ == "__main__":
    main()

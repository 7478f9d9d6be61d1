"""Quick micro-benchmark of one layer's decode attention (one query token), not a test.

    python scripts/bench_kernels_quick.py [--threads N] [--reps 30] [--lengths 4096 16384]

Compares the numba kernels (q8, q8 int-dot, f32, f16) with torch SDPA over an f32 cache and with
"dequantize the whole int8 cache, then SDPA" (what a non-fused q8 path costs). Methods run
interleaved, round after round, so a noisy neighbour hits them alike; min and median are reported,
and the speed-up is taken on the mins (on a shared box the median mostly measures the neighbours).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import torch
import torch.nn.functional as F

from kvlens.kernels import cpu
from kvlens.kv.cache import RowStore
from kvlens.kv.quant import dequantize_q8

SHAPES = {"SmolLM2 (9/3, hd 64)": (9, 3, 64), "8B (32/8, hd 128)": (32, 8, 128)}


def methods(n_heads: int, n_kv: int, hd: int, length: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    kf, vf = (torch.randn(n_kv, length, hd, generator=gen) for _ in range(2))
    stores = {}
    for kind in ("q8", "f32", "f16"):
        ks, vs = (
            RowStore.empty(kind, n_kv, length, hd, torch.device("cpu")),
            RowStore.empty(kind, n_kv, length, hd, torch.device("cpu")),
        )
        ks.write(0, kf)
        vs.write(0, vf)
        stores[kind] = (ks, vs)
    q = torch.randn(n_heads, hd, generator=gen)
    q4 = q[None, :, None, :]
    (k8, v8), (k32, v32) = stores["q8"], stores["f32"]

    def sdpa(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q4, k[None], v[None], enable_gqa=True)

    def deq_sdpa() -> torch.Tensor:
        return sdpa(dequantize_q8(k8.data, k8.scale), dequantize_q8(v8.data, v8.scale))

    return {
        "numba q8": lambda: cpu.decode_attention(q, k8, v8, length),
        "numba q8-intdot": lambda: cpu.decode_attention(q, k8, v8, length, int_dot=True),
        "numba f32": lambda: cpu.decode_attention(q, k32, v32, length),
        "numba f16": lambda: cpu.decode_attention(q, *stores["f16"], length),
        "SDPA f32 cache": lambda: sdpa(k32.data, v32.data),
        "dequant q8 + SDPA": deq_sdpa,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="numba and torch threads (default: all)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    args = ap.parse_args()
    if args.threads:
        numba.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
    print(f"threads: numba {numba.get_num_threads()}, torch {torch.get_num_threads()}")
    print("| shape | context | method | min ms | median ms | speed-up vs SDPA f32 (min) |")
    print("|---|---|---|---|---|---|")
    for name, (n_heads, n_kv, hd) in SHAPES.items():
        for length in args.lengths:
            fns = methods(n_heads, n_kv, hd, length)
            for f in fns.values():  # compile / warm caches
                f()
                f()
            times: dict[str, list[float]] = {m: [] for m in fns}
            for _ in range(args.reps):
                for m, f in fns.items():
                    t = time.perf_counter()
                    f()
                    times[m].append((time.perf_counter() - t) * 1e3)
            base = min(times["SDPA f32 cache"])  # min: the run least disturbed by other processes
            for m, ts in times.items():
                print(
                    f"| {name} | {length} | {m} | {min(ts):.3f} | {statistics.median(ts):.3f} | {base / min(ts):.2f}x |"
                )
    print(f"numba threading layer: {numba.threading_layer()}")


if __name__ == "__main__":
    main()

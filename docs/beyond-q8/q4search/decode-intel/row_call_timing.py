"""One-off measurement behind docs/beyond-q8.md ("Decode at 8K on an Intel Xeon"), session 9.
Output: row_call_timing.out (measured while a `lab plan` job ran on the box).

    .venv/bin/python docs/beyond-q8/q4search/decode-intel/row_call_timing.py

Per-call time of RowStore.write and RowStore.basis for one Gemma-3-shaped row [1, 1, 256]."""

import time

import torch

from kvlens.kv.cache import RowStore
from kvlens.kv.modes import StoreKind

CALLS = 2000
torch.manual_seed(0)
for kind in (StoreKind.Q8, StoreKind.Q4H, StoreKind.Q4):
    store = RowStore.empty(kind, 1, 4096, 256, torch.device("cpu"), with_ksum=True)
    rows = torch.randn(1, 1, 256)
    for i in range(50):  # warm-up: compiles the JIT paths
        store.write(i, store.basis(rows))
    t = time.perf_counter()
    for i in range(CALLS):
        store.write(i % 4096, rows)
    t_write = (time.perf_counter() - t) / CALLS * 1e6
    t = time.perf_counter()
    for _ in range(CALLS):
        store.basis(rows)
    t_basis = (time.perf_counter() - t) / CALLS * 1e6
    print(kind.name, f"write {t_write:.1f} us, basis {t_basis:.1f} us")

"""Seconds numba spends compiling each function during `kvlens serve`'s warm-up, in a process with
an empty cache: run as `NUMBA_CACHE_DIR=$(mktemp -d) python warmup_compiles.py` (docs/testing.md,
session 15). A function's seconds include the callees compiled inside it (`decode_layer` holds
`_attend`, `_linear`, ...), so the rows overlap."""

import collections
import time

from numba.core import event

import kvlens
from kvlens.serve.cli import warm_up

seconds: collections.Counter = collections.Counter()
count: collections.Counter = collections.Counter()
started: dict = {}


class CompileTimes(event.Listener):
    def on_start(self, ev: event.Event) -> None:
        started[id(ev.data["dispatcher"]), str(ev.data["args"])] = time.perf_counter()

    def on_end(self, ev: event.Event) -> None:
        t0 = started.pop((id(ev.data["dispatcher"]), str(ev.data["args"])))
        name = ev.data["dispatcher"].py_func.__qualname__
        seconds[name] += time.perf_counter() - t0
        count[name] += 1


event.register("numba:compile", CompileTimes())
llm = kvlens.load("smollm2", kv="q8", weights="f32")
print(f"warm-up {warm_up(llm):.1f} s")
for name, s in seconds.most_common(12):
    print(f"{s:7.1f} s  x{count[name]}  {name}")

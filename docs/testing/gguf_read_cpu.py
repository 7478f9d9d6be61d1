"""One-off measurement behind docs/testing.md ("Reading GGUF files"), session 9. Output: gguf_read_cpu.out.

    .venv/bin/python docs/testing/gguf_read_cpu.py view; .venv/bin/python docs/testing/gguf_read_cpu.py memmap

CPU seconds (time.process_time) of opening each model's GGUF and of ``kvlens.load``; ``memmap``
swaps gguf's own reader in for kvlens' viewed one."""

import sys
import time

import gguf

import kvlens
from kvlens.models import gguf_loader
from kvlens.models.loader import GEMMA3, resolve_model

which = sys.argv[1]
if which == "memmap":
    gguf_loader.gguf_reader_class = lambda: gguf.GGUFReader
reader_class = gguf_loader.gguf_reader_class()
for name in ("smollm2", "gemma3-270m"):
    path = resolve_model(GEMMA3 if name != "smollm2" else "smollm2")
    t = time.process_time()
    reader_class(path)
    t_reader = time.process_time() - t
    t = time.process_time()
    kvlens.load(name, kv="q8")
    t_load = time.process_time() - t
    print(which, name, f"reader {t_reader:.1f} s CPU, kvlens.load {t_load:.1f} s CPU", flush=True)

"""What a decode attention call leaves behind on its CPU: per layer (30, SmolLM2, 4K, a real cache
filled from the corpus), attention over the layer's K/V, then the layer's gate_up matvec; the
matvec alone is timed (median of 8 passes over the 30 layers, ms per pass).

    python linger.py MODES [--between none|sleep|evict|zclear] [--other-cpu] [--ftz]

MODES: comma list of KV modes (f16, q8, q8-k, q8-v, q4, bf16, f32, or "none": no attention); the
float kernel (kernels.cpu.decode_attention, the default), or with "@int16" (q8@int16) the 16-bit
integer kernel (kernels.cpu_int.decode_attention_int) over the same stores.
--between: what runs (untimed) between the attention and the matvec: a 0.3 ms sleep, a strided
read of 4 MiB (one load per 64 B line), or zeroing all 32 zmm registers (inline asm).
--other-cpu: the attention on CPU 0, the matvec on CPU 1 (os.sched_setaffinity), else both on CPU 0.
--ftz: flush-to-zero and denormals-are-zero on (torch.set_flush_denormal) before anything runs.
Run with NUMBA_NUM_THREADS=1 (one thread: the pinning then says which CPU does what).
"""

import argparse
import os
import statistics
import time

import numpy as np
import torch
from numba import njit, types
from numba.extending import intrinsic

import kvlens
from kvlens.bench.decode import corpus_ids, fill_cache
from kvlens.kernels.cpu import decode_attention
from kvlens.kernels.cpu_int import decode_attention_int
from kvlens.kernels.decode_step import matvec

ap = argparse.ArgumentParser()
ap.add_argument("modes")
ap.add_argument("--between", default="none", choices=("none", "sleep", "evict", "zclear"))
ap.add_argument("--other-cpu", action="store_true")
ap.add_argument("--ftz", action="store_true")
args = ap.parse_args()
if args.ftz:
    print("flush denormals:", torch.set_flush_denormal(True))


@intrinsic
def _zero_zmm(typingctx):
    from llvmlite import ir

    def codegen(context, builder, sig, _args):
        text = "; ".join(f"vpxord %zmm{i}, %zmm{i}, %zmm{i}" for i in range(32))
        clobbers = ",".join(f"~{{xmm{i}}}" for i in range(32))
        builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, clobbers, side_effect=True), [])
        return context.get_dummy_value()

    return types.void(), codegen


@njit
def zero_zmm():
    _zero_zmm()


@njit
def touch(a):  # one load per 64-byte line
    s = np.float32(0)
    for i in range(0, a.size, 16):
        s += a[i]
    return s


if args.between == "zclear":
    import llvmlite.binding as llb

    llb.initialize_native_asmparser()
    zero_zmm()
evict = np.random.rand(2**20).astype(np.float32)
touch(evict)

ctx = 4096
llm = kvlens.load("smollm2", kv="f32", weights="auto")
ids = corpus_ids(llm, ctx - 1)
src = llm.new_cache(ctx - 1, "f32")
llm.variant(attn_backend="torch").prefill(ids, src, chunk=512)
modes = args.modes.split(",")
caches = {m: fill_cache(llm, src, m.split("@")[0], ctx - 1, ctx) for m in modes if m != "none"}
del src
dec = llm.fused
h = np.random.rand(1, dec.shape.hidden).astype(np.float32)
gu = np.empty((1, 2 * dec.shape.ffn), np.float32)
q = torch.randn(dec.shape.n_heads, dec.shape.head_dim)


def one_pass(mode: str) -> float:
    total = 0
    for layer in range(len(dec.layers)):
        if args.other_cpu:
            os.sched_setaffinity(0, {0})
        if mode != "none":
            (decode_attention_int if mode.endswith('@int16') else decode_attention)(q, caches[mode].k[layer], caches[mode].v[layer], ctx - 1)
        if args.between == "sleep":
            time.sleep(0.0003)
        elif args.between == "evict":
            touch(evict)
        elif args.between == "zclear":
            zero_zmm()
        if args.other_cpu:
            os.sched_setaffinity(0, {1})
        t0 = time.perf_counter_ns()
        matvec(dec.layers[layer][6], h, gu)
        total += time.perf_counter_ns() - t0
    return total / 1e6


if not args.other_cpu:
    os.sched_setaffinity(0, {0})
for m in modes:
    one_pass(m)
print(f"between {args.between}, matvec on {'the other' if args.other_cpu else 'the same'} CPU")
for _ in range(3):
    print("  gate_up matvec, 30 layers, after:",
          " ".join(f"{m} {statistics.median(one_pass(m) for _ in range(8)):.2f} ms" for m in modes), flush=True)  # fmt: skip

"""Where the fused decode step's time goes, by stage: a copy of kernels.decode_step.decode_layer with
cycle-counter stamps (llvm.readcyclecounter) between its stages, put in its place; each stage's share
of the stamped cycles times the step's measured ms (the step also holds a little Python between layers).

    python stages.py MODE [CTX [ATTN_BACKEND]]      (SmolLM2, auto weights, 3 rounds of 12 steps)

Stages: qkv (norm, QKV matvec, RoPE), attend (attend_row: KV write and attention), oproj (o-proj and
the residual add), gateup (norm, gate/up matvec), down (SiLU, down matvec, residual add)."""
import sys
import numpy as np
from llvmlite import ir
from numba import njit, types, literally
from numba.core import cgutils
from numba.extending import intrinsic
import kvlens
from kvlens.kernels import decode_step as ds
from kvlens.kernels.rowops import rms_norm_row, rope_split_row, silu_mul_row
from kvlens.bench.decode import corpus_ids, fill_cache, time_decode

@intrinsic
def rdtsc(typingctx):
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []), "llvm.readcyclecounter")
        return builder.call(fn, [])
    return types.int64(), codegen

@njit
def decode_layer_t(kind, path, x, lw, ks, vs, pos, rope, at, buf, min_work):
    kind, path = literally(kind), literally(path)
    st = buf[4]
    attn_norm, ffn_norm, eps, wqkv, bqkv, wo, wgu, wdown = lw
    h, qkv, q, k, v, o, proj, gu, act = buf[0]
    t0 = rdtsc()
    rms_norm_row(x[0], attn_norm, eps, h[0])
    ds._linear(wqkv, bqkv, h, qkv, min_work)
    rope_split_row(qkv[0], rope[0], rope[1], q, k, v)
    t1 = rdtsc(); st[0] += t1 - t0
    bad = ds.attend_row(kind, path, q, k, v, ks, vs, pos, at, buf[1], buf[2], o, buf[3])
    t2 = rdtsc(); st[1] += t2 - t1
    if bad != -1:
        return bad
    no_bias = bqkv[:0]
    ds._linear(wo, no_bias, o.reshape(1, o.size), proj, min_work)
    ds._add(x, proj)
    t3 = rdtsc(); st[2] += t3 - t2
    rms_norm_row(x[0], ffn_norm, eps, h[0])
    ds._linear(wgu, no_bias, h, gu, min_work)
    t4 = rdtsc(); st[3] += t4 - t3
    silu_mul_row(gu[0], act[0])
    ds._linear(wdown, no_bias, act, proj, min_work)
    ds._add(x, proj)
    t5 = rdtsc(); st[4] += t5 - t4
    return -1

STAMPS = np.zeros(8, np.int64)
ds.decode_layer = decode_layer_t
_init = ds.FusedDecoder.__init__
def init(self, *a, **kw):
    _init(self, *a, **kw)
    self.buf = self.buf + (STAMPS,)
ds.FusedDecoder.__init__ = init

mode, ctx = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4096
backend = sys.argv[3] if len(sys.argv) > 3 else None
llm = kvlens.load("smollm2", kv=mode, weights="auto", attn_backend=backend or "auto")
ids = corpus_ids(llm, ctx - 1)
src = llm.new_cache(ctx - 1, "f32")
llm.variant(attn_backend="torch").prefill(ids, src, chunk=512)
cache = fill_cache(llm, src, mode, ctx - 1, ctx)
del src
time_decode(llm, cache, ctx - 1, 12, llm.attn_backend)
for r in range(3):
    STAMPS[:] = 0
    t = time_decode(llm, cache, ctx - 1, 12, llm.attn_backend)
    tot = STAMPS[:5].sum()
    ms = 1e3 * t[0]
    parts = [ms * s / tot for s in STAMPS[:5]]
    print(mode, ctx, f"step {ms:.2f} ms", "qkv %.2f attend %.2f oproj %.2f gateup %.2f down %.2f" % tuple(parts), flush=True)

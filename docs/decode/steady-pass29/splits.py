"""Fused vs general decode at 4K, f16 vs q8, with the attention's splits per KV head forced."""
import sys
import kvlens
from kvlens.kernels import flash
from kvlens.bench.decode import run_decode_bench

llm = kvlens.load("smollm2", kv="q8", weights="auto")
real = flash.choose_splits
for n in [int(a) if a != "d" else None for a in sys.argv[1:]]:
    flash.choose_splits = real if n is None else (lambda length, n_kv, n_threads=None, n=n: n)
    rows = run_decode_bench([llm], [4096], ["f16", "q8"], steps=12, with_hf=False, rounds=3, step_kinds=("fused", "general"))
    t = {(r.mode, r.step): r.tok_per_s for r in rows}
    print(f"splits {n or 'default'}: " + ", ".join(f"{m} {k} {v:.1f}" for (m, k), v in t.items())
          + f"; q8/f16 fused {t['q8','fused']/t['f16','fused']:.2f}, general {t['q8','general']/t['f16','general']:.2f}", flush=True)

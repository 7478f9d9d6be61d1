"""Per round: 12 q8 decode steps at 4K (as bench decode times them), then three machine probes:
memory read (bench's ReadProbe), a compute loop in L1 on both threads (numba parallel), and the same
compute loop pinned to each CPU alone. Which probe moves with tok/s?"""
import os, sys, time, resource, subprocess
import numba, numpy as np
from numba import njit, prange
import kvlens
from kvlens.bench.bandwidth import MachineProbe
from kvlens.bench.decode import corpus_ids, fill_cache, time_decode

@njit(fastmath=True, cache=True)
def fma_loop(x, n):
    acc = np.zeros(16, np.float32)
    for _ in range(n):
        for i in range(16):
            acc[i] = acc[i] * np.float32(0.999) + x[i]
    return acc.sum()

@njit(parallel=True, fastmath=True, cache=True)
def fma_par(x, n, k):
    out = np.zeros(k, np.float32)
    for c in prange(k):
        acc = np.zeros(16, np.float32)
        for _ in range(n):
            for i in range(16):
                acc[i] = acc[i] * np.float32(0.999) + x[i]
        out[c] = acc.sum()
    return out.sum()

@njit(parallel=True, cache=True)
def fj_par(x, reps):
    for r in range(reps):
        for c in prange(x.shape[0]):
            x[c, 0] += 1.0
    return x[0, 0]

N = 2_000_000
x = np.ones(16, np.float32)
def best(f, reps=3):
    b = 1e9
    for _ in range(reps):
        t0 = time.perf_counter(); f(); b = min(b, time.perf_counter() - t0)
    return b

llm = kvlens.load("smollm2", kv="q8", weights="auto")
ctx = 4096
ids = corpus_ids(llm, ctx - 1)
src = llm.new_cache(ctx - 1, "f32")
llm.variant(attn_backend="torch").prefill(ids, src, chunk=512)
cache = fill_cache(llm, src, "q8", ctx - 1, ctx)
probe = MachineProbe()
k = numba.get_num_threads()
fma_loop(x, 10); fma_par(x, 10, k)
all_cpus = os.sched_getaffinity(0)
def vm():
    d = {}
    for ln in open("/proc/vmstat"):
        k, v = ln.split()
        if k.startswith(("pgfault", "pgmajfault", "thp_", "compact_", "pgmigrate", "numa_")):
            d[k] = int(v)
    return d
def steal():
    f = open("/proc/stat").readline().split()
    return int(f[8]), int(f[4])  # steal, idle (jiffies)
print("round tok/s read_GB/s [pingpong_ns fma0 fma1 fma0_both fma1_both] | cpu_s/wall minflt nivcsw nvcsw steal_j idle_j vmstat", flush=True)
for r in range(int(sys.argv[1])):
    ru0, vm0, st0, w0 = resource.getrusage(resource.RUSAGE_SELF), vm(), steal(), time.perf_counter()
    t = time_decode(llm, cache, ctx - 1, 12, llm.attn_backend)[0]
    ru1, vm1, st1, w1 = resource.getrusage(resource.RUSAGE_SELF), vm(), steal(), time.perf_counter()
    cpu = (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) / (w1 - w0)
    dv = {k: vm1[k] - vm0.get(k, 0) for k in vm1 if vm1[k] != vm0.get(k, 0)}
    extra = f"| {cpu:.2f} {ru1.ru_minflt-ru0.ru_minflt} {ru1.ru_nivcsw-ru0.ru_nivcsw} {ru1.ru_nvcsw-ru0.ru_nvcsw} {st1[0]-st0[0]} {st1[1]-st0[1]} {dv}"
    rd = probe.sample()[0]
    xfj = np.zeros((k, 16)); fj_par(xfj, 10)
    t0 = time.perf_counter(); fj_par(xfj, 5000); fj = (time.perf_counter() - t0) / 5000 * 1e6
    cp = subprocess.run(["/tmp/probe/cpuprobe"], capture_output=True, text=True).stdout.strip()
    print(f"{r} {1/t:.1f} {rd:.1f} fj={fj:.2f}us [{cp}] " + extra, flush=True)

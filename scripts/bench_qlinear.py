"""Kept-quantized weights: matmul timings and SmolLM2 decode/prefill step times per weight mode.

    python scripts/bench_qlinear.py [--threads 1,2] [--rounds 5] [--skip-matmul] [--skip-model]

Every timing is a median over rounds in which all variants run interleaved, so a noisy shared
machine slows them alike. Matmuls compare f32 ``F.linear`` with our bf16/int8/int4 layers and
torch's built-in weight-only ops (``_weight_int8pack_mm``: per-channel int8;
``_weight_int4pack_mm_for_cpu``: group-32 int4). Model rows: ms per decode step (one token after
a 32-token prompt, f32 KV cache, torch attention) and per 256-token prefill; f32 / bf16 / int8 /
int4 are converted from the f32 load, auto is the GGUF load (int4 layers, int8 head).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import numba
import torch
import torch.nn.functional as F

import kvlens
from kvlens.models.loader import load_model
from kvlens.models.qlinear import BF16Linear, Int4Linear, Int8Linear
from kvlens.models.weights import convert_weights

SHAPES = [(960, 576, "wqkv"), (3072, 576, "gate_up"), (576, 1536, "down"), (49152, 576, "lm_head")]


def timed(
    fns: dict[str, Callable[[], object]], rounds: int, min_s: float = 0.05
) -> dict[str, tuple[float, float]]:
    """Median (wall ms, CPU ms) per call of each function, rounds interleaved across functions.

    CPU time (all threads of the process) is the steadier number on a shared machine; with one
    thread it is the compute time itself, with more it also counts threads spinning at barriers.
    """
    reps = {}
    for name, fn in fns.items():
        fn()
        t0 = time.perf_counter()
        fn()
        reps[name] = max(1, int(min_s / max(time.perf_counter() - t0, 1e-6)))
    wall: dict[str, list[float]] = {n: [] for n in fns}
    cpu: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(reps[name]):
                fn()
            wall[name].append((time.perf_counter() - t0) / reps[name] * 1e3)
            cpu[name].append((time.process_time() - c0) / reps[name] * 1e3)
    return {n: (statistics.median(wall[n]), statistics.median(cpu[n])) for n in fns}


def torch_int8(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    s = w.abs().amax(1) / 127
    q = torch.round(w / s[:, None]).to(torch.int8)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, s)


def torch_int4(w: torch.Tensor, g: int = 32) -> Callable[[torch.Tensor], torch.Tensor]:
    n, k = w.shape
    wg = w.view(n, k // g, g)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    s = (hi - lo).clamp(min=1e-6) / 15
    q = torch.round((wg - lo) / s).clamp(0, 15).to(torch.int32).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    sz = torch.cat([s, lo + 8 * s], -1).view(n, k // g, 2).transpose(0, 1).contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, sz)


def bench_matmul(rounds: int) -> None:
    print("\n## matmul, ms per call: median wall (CPU)\n")
    print("| threads | shape | m | f32 | bf16 | int8 | int4 | torch int8pack | torch int4pack |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, k, what in SHAPES:
        w = torch.randn(n, k)
        layers = {c.kind: c.from_float(w) for c in (BF16Linear, Int8Linear, Int4Linear)}
        t8, t4 = torch_int8(w), torch_int4(w)
        for m in (1, 512):
            if m == 512 and n > 10000:
                continue  # the torch ops take seconds here
            x = torch.randn(m, k)
            fns = {"f32": lambda x=x, w=w: F.linear(x, w)}
            fns.update({kind: (lambda x=x, L=L: L(x)) for kind, L in layers.items()})
            fns["t8"], fns["t4"] = (lambda x=x, f=t8: f(x)), (lambda x=x, f=t4: f(x))
            r = timed(fns, rounds)
            cells = " | ".join(
                f"{r[c][0]:.3f} ({r[c][1]:.3f})" for c in ("f32", "bf16", "int8", "int4", "t8", "t4")
            )
            print(f"| {torch.get_num_threads()} | {what} {n}x{k} | {m} | {cells} |", flush=True)


def build_llms() -> dict[str, kvlens.LLM]:
    base = load_model("smollm2")
    llms = {"f32": kvlens.LLM(base, kv="f32", attn_backend="torch")}
    for m in ("bf16", "int8", "int4"):
        loaded = replace(base, weights=convert_weights(base.weights, m), weights_mode=m)
        llms[m] = kvlens.LLM(loaded, kv="f32", attn_backend="torch")
    llms["auto"] = kvlens.LLM(load_model("smollm2", weights="auto"), kv="f32", attn_backend="torch")
    return llms


def weight_mib(llm: kvlens.LLM) -> float:
    w = llm.model.w
    mats = [w.embed] + [getattr(L, f) for L in w.layers for f in ("wqkv", "wo", "w_gate_up", "w_down")]
    if w.lm_head is not w.embed:
        mats.append(w.lm_head)
    return (
        sum(x.numel() * x.element_size() if isinstance(x, torch.Tensor) else x.nbytes for x in mats) / 2**20
    )


def bench_model(llms: dict[str, kvlens.LLM], rounds: int) -> None:
    tok = llms["f32"].tokenizer
    ids = tok.encode("The history of the encyclopaedia begins in antiquity, when scholars compiled " * 40)
    prompt, long = ids[:32], ids[:256]
    caches = {m: llm.new_cache(300) for m, llm in llms.items()}
    for m, llm in llms.items():
        llm.prefill(prompt, caches[m])

    def step(llm: kvlens.LLM, cache) -> Callable[[], object]:
        return lambda: llm.model.logits(llm.forward([17], cache, 32, prefill=False))

    ds = timed({m: step(llm, caches[m]) for m, llm in llms.items()}, rounds, 0.3)
    ps = timed({m: (lambda llm=llm: llm.prefill(long, llm.new_cache(256))) for m, llm in llms.items()}, 3, 0)
    print(
        f"\n## SmolLM2-135M, {torch.get_num_threads()} thread(s): ms per decode step, per 256-token prefill\n"
    )
    print("| weights | weight MiB | decode wall | decode CPU | f32/this (CPU) | prefill wall | prefill CPU |")
    print("|---|---|---|---|---|---|---|")
    for m, llm in llms.items():
        print(
            f"| {m} | {weight_mib(llm):.0f} | {ds[m][0]:.1f} | {ds[m][1]:.1f} | {ds['f32'][1] / ds[m][1]:.2f} "
            f"| {ps[m][0]:.0f} | {ps[m][1]:.0f} |",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip-matmul", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    a = ap.parse_args()
    # Start numba's thread pool first: with the OpenMP layer its start resets the thread count that
    # torch reads too.
    Int8Linear.from_float(torch.randn(64, 64))(torch.randn(1, 64))
    llms = None if a.skip_model else build_llms()
    for t in (int(s) for s in a.threads.split(",")):
        numba.set_num_threads(min(t, numba.config.NUMBA_NUM_THREADS))
        torch.set_num_threads(t)
        with torch.inference_mode():
            if not a.skip_matmul:
                bench_matmul(a.rounds)
            if llms is not None:
                bench_model(llms, a.rounds)


if __name__ == "__main__":
    main()

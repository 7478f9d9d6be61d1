"""``kvlens bench attention``: one layer's decode attention (one query token) per call, side by side.

For each head shape, context and cache mode, every backend is timed over a working set larger than
the last-level cache: ``n_layers`` distinct copies of the layer's K/V are allocated (about 4x the
LLC, capped by ``mem_gib``) and each timed sweep calls the kernel once per layer in turn, so every
call streams its K/V from DRAM as a real decode step over many layers does.

Backends:
    numba          the fused kernel (kvlens.kernels.cpu.decode_attention), every mode
    numba-intdot   its int8-query variant (q8 K only)
    numba-int      integer Q·K scores through the CPU's dot-product instructions, int8 query per
                   32-block (kvlens.kernels.cpu_int; q8 K only); numba-int16: int16 query;
                   ``:PATH`` forces a CPU path (vnni512, vnni256, avx2, portable)
    torch-sdpa     torch scaled_dot_product_attention over the f32 cache (the baseline)
    dequant-sdpa   read the whole cache as f32 (dequantize int8 / widen f16), then SDPA: the engine's
                   torch path and what HF's quantized cache does; non-f32 modes only (for f32 it *is*
                   torch-sdpa)
    triton         the Triton kernel (CUDA, or TRITON_INTERPRET=1 on CPU for tests)

GB/s counts the cache's bytes for ``ctx`` positions (K, V rows and int8 row scales), the least any
implementation must read. The limit is measured in the same run: copy = torch ``dst.copy_(src)``,
2 x bytes / time (the issue's yardstick, ``frac_of_copy_bw``), and read = a numba parallel sum
(``frac_of_read_bw``, the real limit of a read-only kernel). Times: min over ``reps`` interleaved
rounds (the run least disturbed by neighbours), median and max beside it; a warning names the likely
cause when the rounds disagree by more than 10% (:mod:`.spread`). Results: docs/kernels.md.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numba
import torch

from ..checks import check_counts, check_field_types, check_finite_fields, check_list_fields
from ..kernels.cpu import decode_attention
from ..kernels.cpu_int import IntAttn, decode_attention_int
from ..kernels.gpu import decode_attention_triton  # imports triton only when called
from ..kernels.reference import sdpa_attention
from ..kernels.threads import set_threads
from ..kv.cache import RowStore
from ..kv.modes import MODES, KVMode, StoreKind, split_mode_list
from .attention_rows import AttnRow, render, spread_warnings
from .bandwidth import Bandwidth, MachineProbe, MiB, llc_bytes, measure_bandwidth, sync
from .spread import MachineSpread, spread

# heads, KV heads, head_dim: SmolLM2-135M, Llama-3-8B, Gemma-3-270M
SHAPES: dict[str, tuple[int, int, int]] = {"smollm2": (9, 3, 64), "8b": (32, 8, 128), "gemma3": (4, 1, 256)}
CPU_BACKENDS = ("numba", "numba-intdot", "numba-int", "numba-int16", "torch-sdpa", "dequant-sdpa")
ALL_BACKENDS = (*CPU_BACKENDS, "triton")


def layer_bytes(mode: str, n_kv: int, ctx: int, hd: int) -> int:
    m = KVMode.parse(mode)
    return n_kv * ctx * (m.k.row_bytes(hd) + m.v.row_bytes(hd))


def plan_layers(modes: list[str], n_kv: int, ctx: int, hd: int, llc: int, mem_gib: float) -> dict[str, int]:
    """Layers per mode: working set ~ max(4 x LLC, one layer), all modes together within ``mem_gib``."""
    want = {m: max(1, math.ceil(4 * llc / layer_bytes(m, n_kv, ctx, hd))) for m in modes}
    total = sum(want[m] * layer_bytes(m, n_kv, ctx, hd) for m in modes)
    budget = mem_gib * 2**30
    if total > budget:  # shrink every mode alike, never below one layer
        want = {m: max(1, int(n * budget / total)) for m, n in want.items()}
    return want


def build_layers(mode: str, n_layers: int, n_kv: int, ctx: int, hd: int, device: torch.device, seed: int = 0):
    """``n_layers`` distinct (K, V) RowStore pairs holding ``ctx`` positions of random rows.

    One layer is written (so int8 rows are really quantized), the others are copies: the cost of a
    call depends on where the bytes are, not on their values."""
    gen = torch.Generator().manual_seed(seed)
    m = KVMode.parse(mode)
    kf, vf = (torch.randn(n_kv, ctx, hd, generator=gen).to(device) for _ in range(2))
    k0 = RowStore.empty(m.k, n_kv, ctx, hd, device, with_ksum=True)
    v0 = RowStore.empty(m.v, n_kv, ctx, hd, device)
    k0.write(0, kf)
    v0.write(0, vf)
    del kf, vf

    def clone(s: RowStore) -> RowStore:
        return RowStore(s.kind, *(None if t is None else t.clone() for t in (s.data, s.scale, s.ksum)))

    return [(k0, v0)] + [(clone(k0), clone(v0)) for _ in range(n_layers - 1)]


def make_call(backend: str, layers, q: torch.Tensor, ctx: int) -> Callable[[int], object] | None:
    """A ``call(i)`` running ``backend`` over layer ``i``, or None where it does not apply."""
    kinds, q3 = (layers[0][0].kind, layers[0][1].kind), q[:, None, :]
    spec = IntAttn.parse(backend)
    if spec is not None:
        return (
            (lambda i: decode_attention_int(q, *layers[i], ctx, spec=spec)) if spec.scores(kinds[0]) else None
        )
    calls = {
        "numba": lambda i: decode_attention(q, *layers[i], ctx),
        "numba-intdot": lambda i: decode_attention(q, *layers[i], ctx, int_dot=True),
        "torch-sdpa": lambda i: sdpa_attention(q3, layers[i][0].data, layers[i][1].data),
        "dequant-sdpa": lambda i: sdpa_attention(q3, layers[i][0].read(0, ctx), layers[i][1].read(0, ctx)),
        "triton": lambda i: decode_attention_triton(q, *layers[i], ctx),
    }
    exact = kinds == (StoreKind.F32, StoreKind.F32)
    applies = {"numba-intdot": kinds[0].int8, "torch-sdpa": exact, "dequant-sdpa": not exact}
    return calls[backend] if applies.get(backend, True) else None


def triton_device() -> torch.device | None:
    """Where the triton backend runs: CUDA, or the CPU under TRITON_INTERPRET=1; None if nowhere."""
    if importlib.util.find_spec("triton") is None:
        return None
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu") if os.environ.get("TRITON_INTERPRET") == "1" else None


def time_cells(
    cells: dict,
    n_layers: dict,
    reps: int,
    device_of: dict,
    min_round_s: float,
    probe: MachineProbe | None = None,
) -> dict:
    """Seconds per call of every cell: ``reps`` rounds, cells interleaved within each round, each
    cell timing whole sweeps over its layers (repeated to last ``min_round_s``); ``probe`` samples the
    machine after every round."""

    def sweep(key, times: int) -> float:
        call, dev, n = cells[key], device_of[key], n_layers[key]
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(times):
            for i in range(n):
                call(i)
        sync(dev)
        return (time.perf_counter() - t0) / (times * n)

    sweeps = {}
    for key in cells:  # warm up (numba compile, page faults), then size the sweeps
        cells[key](0)
        sweeps[key] = max(1, math.ceil(min_round_s / max(sweep(key, 1) * n_layers[key], 1e-9)))
    times: dict = {key: [] for key in cells}
    for _ in range(reps):
        for key in cells:
            times[key].append(sweep(key, sweeps[key]))
        if probe is not None:
            probe.sample()
    return times


def check_cells(
    modes: list[str], shapes: list[str], backends: list[str] | None
) -> tuple[list[str], torch.device | None]:
    """Refuse unknown modes, shapes and backends; returns the backends (None: every one that runs
    here) and the device the triton backend runs on (None: nowhere)."""
    bad_mode = next((m for m in modes if m not in MODES or MODES[m].mirror), None)
    if bad_mode:
        named = ", ".join(m for m, mode in MODES.items() if not mode.mirror)
        raise ValueError(f"mode {bad_mode!r}: bench attention takes {named}")
    if any(s not in SHAPES for s in shapes):
        raise ValueError(f"unknown shape in {shapes}; choose from {', '.join(SHAPES)}")
    tdev = triton_device()
    if backends is None:
        backends = list(CPU_BACKENDS) + (["triton"] if tdev is not None and tdev.type == "cuda" else [])
    if any(b not in ALL_BACKENDS and IntAttn.parse(b) is None for b in backends):
        raise ValueError(f"unknown backend in {backends}; choose from {', '.join(ALL_BACKENDS)}")
    if "triton" in backends and tdev is None:
        raise ValueError("the triton backend needs triton and a CUDA device (or TRITON_INTERPRET=1)")
    return backends, tdev


@dataclass(frozen=True)
class _Sizing:
    """Rounds, least seconds per round, LLC size the working set fits (None: the device's), cache cap,
    and the machine probe sampled after every round (None: not sampled)."""

    reps: int
    min_round_s: float
    llc: int | None
    mem_gib: float
    probe: MachineProbe | None = None


class _Timed(NamedTuple):
    """One (shape, ctx)'s cells, per (mode, backend): seconds per round, layers swept, device."""

    times: dict
    n_layers: dict
    device_of: dict
    machine: MachineSpread | None = None


def _time_shape(
    shape: str, ctx: int, modes: list[str], backends: list[str], devices: set, tdev, sizing: _Sizing
) -> _Timed:
    """Build each device's layer caches for one (shape, ctx) and time every (mode, backend) cell."""
    n_heads, n_kv, hd = SHAPES[shape]
    cpu = torch.device("cpu")
    # torch-sdpa is the baseline of every row: it needs the f32 cache even if f32 is not listed
    store_modes = modes + (["f32"] if "torch-sdpa" in backends and "f32" not in modes else [])
    cells, n_layers, device_of, stores = {}, {}, {}, {}
    for dev in devices:
        dev_llc = sizing.llc or (
            torch.cuda.get_device_properties(dev).L2_cache_size if dev.type == "cuda" else llc_bytes()
        )
        dev_modes = store_modes if dev.type == "cpu" else modes
        plan = plan_layers(dev_modes, n_kv, ctx, hd, dev_llc, sizing.mem_gib)
        for m in dev_modes:
            stores[dev.type, m] = build_layers(m, plan[m], n_kv, ctx, hd, dev)
    q = torch.randn(n_heads, hd, generator=torch.Generator().manual_seed(1))
    for m in store_modes:
        for b in backends:
            if m not in modes and b != "torch-sdpa":
                continue
            dev = tdev if b == "triton" else cpu
            call = make_call(b, stores[dev.type, m], q.to(dev), ctx)
            if call is not None:
                cells[m, b] = call
                n_layers[m, b] = len(stores[dev.type, m])
                device_of[m, b] = dev
    first_sample = len(sizing.probe.reads) if sizing.probe else 0
    times = time_cells(cells, n_layers, sizing.reps, device_of, sizing.min_round_s, sizing.probe)
    return _Timed(times, n_layers, device_of, sizing.probe.spread(first_sample) if sizing.probe else None)


def _rows(
    shape: str, ctx: int, modes: list[str], timed: _Timed, bandwidth: dict[str, Bandwidth], threads: int
) -> list[AttnRow]:
    """One row per timed cell of a listed mode: best µs, GB/s against the device's bandwidth, and
    the speed-ups over f32 torch SDPA and over dequantize-then-SDPA of the same mode."""
    _, n_kv, hd = SHAPES[shape]
    best = {key: min(ts) for key, ts in timed.times.items()}
    sdpa = best.get(("f32", "torch-sdpa"))
    rows = []
    for (m, b), ts in timed.times.items():
        if m not in modes:
            continue
        t = best[m, b]
        nbytes = layer_bytes(m, n_kv, ctx, hd)
        dev = timed.device_of[m, b]
        bw = bandwidth[dev.type]
        base = best.get((m, "dequant-sdpa")) if m != "f32" else sdpa
        gbs = nbytes / t / 1e9
        rows.append(
            AttnRow(
                shape, ctx, m, b, 1e6 * t, 1e6 * spread(ts).median, 1e6 * max(ts), nbytes, gbs,
                gbs / bw.copy_gb_per_s, gbs / bw.read_gb_per_s,
                sdpa / t if sdpa else None, base / t if base else None,
                timed.n_layers[m, b], threads, dev.type, timed.machine,
            )
        )  # fmt: skip
    return rows


def run_attention_bench(
    contexts: list[int],
    shapes: list[str],
    modes: list[str],
    backends: list[str] | None = None,
    reps: int = 5,
    mem_gib: float = 3.0,
    bw_bytes: int = 512 * MiB,
    min_round_s: float = 0.02,
    bandwidth: dict[str, Bandwidth] | None = None,
    llc: int | None = None,
    progress: Callable[[str], None] | None = None,
    probe: MachineProbe | None = None,
) -> tuple[list[AttnRow], dict[str, Bandwidth]]:
    """Time every (shape, ctx, mode, backend) cell; returns the rows and the bandwidths per device.

    ``llc`` overrides the last-level cache size the working set is sized from (tests: 1 = one layer);
    ``probe`` samples the machine between the rounds (each (shape, ctx)'s rows carry its spread)."""
    backends, tdev = check_cells(modes, shapes, backends)
    devices = {torch.device("cpu")} | ({tdev} if "triton" in backends else set())
    bandwidth = dict(bandwidth or {})
    for dev in devices:
        if dev.type not in bandwidth:
            bandwidth[dev.type] = measure_bandwidth(bw_bytes, device=dev.type)
    threads = numba.get_num_threads()
    sizing = _Sizing(reps, min_round_s, llc, mem_gib, probe)
    rows: list[AttnRow] = []
    for shape in shapes:
        for ctx in contexts:
            timed = _time_shape(shape, ctx, modes, backends, devices, tdev, sizing)
            rows += _rows(shape, ctx, modes, timed, bandwidth, threads)
            if progress:
                progress(f"{shape} ctx {ctx} done")
    return rows, bandwidth


@dataclass
class AttentionBenchConfig:
    """``kvlens bench attention``: every (shape, context, mode, backend) cell (``backend`` None: all
    that run here), ``reps`` interleaved rounds; with ``sparse`` (methods) dense q8 vs sparse q8 at
    each of ``sparse_budget`` tokens instead."""

    ctx: list[int] = field(default_factory=lambda: [1024, 4096, 16384, 65536])
    shape: list[str] = field(default_factory=lambda: ["smollm2", "8b"])
    kv: list[str] = field(default_factory=lambda: ["f32", "f16", "q8"])
    backend: list[str] | None = None
    threads: int | None = None
    reps: int = 5
    mem_gib: float = 3.0
    prefill: bool = False
    sparse: list[str] | None = None
    sparse_budget: list[int] = field(default_factory=lambda: [1024, 2048])

    def __post_init__(self) -> None:
        check_field_types(self)
        kinds = {"shape": str, "kv": str, "backend": str, "sparse": str, "ctx": int, "sparse_budget": int}
        check_list_fields(
            self, kinds, optional=("backend", "sparse"), split=split_mode_list, may_be_empty=("sparse",)
        )
        check_counts(self, "ctx", "sparse_budget", "threads", "reps")
        check_finite_fields(self, "mem_gib", above=0.0)


def main(cfg: AttentionBenchConfig, json_out: bool = False) -> None:
    """The body of ``kvlens bench attention`` (``--sparse``: :mod:`.sparse`)."""
    from ..report import CommandOutput, run_command
    from . import sparse
    from .prefill_read import render_prefill, time_prefill_read
    from .spread import LoadMeter

    set_threads(cfg.threads)
    if cfg.sparse:
        output = CommandOutput(sparse.render, list)
        run_command("bench attention", 0, lambda _step: sparse.run(cfg), output, json_out)
        return
    say = None if json_out else lambda s: print(f"  {s}", file=sys.stderr)
    meter = LoadMeter()  # other processes' CPU during the run, named by the spread warnings

    def run(_step: Callable[[str], None]) -> tuple[list[AttnRow], dict[str, Bandwidth]]:
        rows, bw = run_attention_bench(
            cfg.ctx, cfg.shape, cfg.kv, cfg.backend, cfg.reps, cfg.mem_gib, progress=say, probe=MachineProbe()
        )
        for line in spread_warnings(rows, meter.read()):
            print(line, file=sys.stderr)
        return rows, bw

    def show(result: tuple[list[AttnRow], dict[str, Bandwidth]]) -> None:
        render(*result)
        if cfg.prefill:
            render_prefill("smollm2", 4096, 32, time_prefill_read("smollm2", 4096, 32))

    output = CommandOutput(show, lambda result: [r.as_dict() for r in result[0]])
    run_command("bench attention", 0, run, output, json_out)

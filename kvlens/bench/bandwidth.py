"""The machine's memory bandwidth and last-level cache, measured or read in the same run as a
benchmark, and the one line of machine context printed under its tables."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
import torch

from ..kernels.cpu_int import IntAttn
from ..kernels.probes import ARITH_CHAINS, arith_chains, fork_joins, parallel_sum
from .spread import MachineSpread, spread

DEFAULT_LLC = 32 * 2**20
MiB = 2**20


@dataclass
class Bandwidth:
    copy_gb_per_s: float
    read_gb_per_s: float
    device: str


LLC_SIZE_FILE = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")  # index3 = L3; "32768K"


def llc_bytes(size_file: Path = LLC_SIZE_FILE) -> int:
    """Last-level cache size from sysfs (binary K/M/G units), else 32 MiB."""
    try:
        s = size_file.read_text(encoding="utf-8").strip().upper()
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1], 1)
        return int(s.rstrip("KMG")) * mult
    except (OSError, ValueError, IndexError):
        return DEFAULT_LLC


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(n_bytes: int = 512 * MiB, reps: int = 5, device: str = "cpu") -> Bandwidth:
    """Copy bandwidth (2 x bytes / time of ``dst.copy_(src)``) and, on CPU, read-only bandwidth."""
    dev = torch.device(device)
    src = torch.ones(n_bytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    t_copy, t_read = [], []
    a = src.numpy() if dev.type == "cpu" else None
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(dev)
        t_copy.append(time.perf_counter() - t0)
        if a is not None:
            t0 = time.perf_counter()
            parallel_sum(a, numba.get_num_threads())
            t_read.append(time.perf_counter() - t0)
    copy = 2 * src.numel() * 4 / min(t_copy) / 1e9
    read = src.numel() * 4 / min(t_read) / 1e9 if t_read else copy / 2  # GPU: no read-only probe
    return Bandwidth(copy, read, device)


def _best_seconds(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class MachineProbe:
    """The machine's own speed, sampled between a benchmark's rounds on all the benchmark's threads, three
    ways: memory read bandwidth (best of ``reps`` parallel sums over a buffer beyond the LLC share a
    guest gets: a 2-vCPU guest whose socket's L3 is 480 MiB read at memory speed from 192 MB up),
    arithmetic rate (best of ``reps`` runs of register-only multiply-add chains) and the threads'
    fork/join round trip (best of ``reps`` means over ``sync_reps`` empty parallel regions), :mod:`kvlens.kernels.probes`.
    A speed that moves with one of them moved with the machine, not the code: the host placing the
    two vCPUs on two dies (read bandwidth up, fork/join 2-3x longer) or sharing their cores (arithmetic
    down); docs/decode.md, the twenty-second pass. Where the benchmark names its working sets
    (:meth:`sample`'s ``sizes``), also the read bandwidth at each of them: a speed that moves with that
    read alone moved with the share of the L3 the host left this guest."""

    def __init__(
        self, n_bytes: int = 256 * MiB, reps: int = 3, arith_iters: int = 1_000_000, sync_reps: int = 5000
    ) -> None:
        self.buf = np.ones(n_bytes // 4, np.float32)  # pages faulted in here, not in the first sample
        self.read_bytes = self.buf.nbytes  # the main read's size (a sized read may grow the buffer)
        self.reps, self.arith_iters, self.sync_reps = reps, arith_iters, sync_reps
        self.reads: list[float] = []  # GB/s
        self.sized: dict[int, list[tuple[int, float]]] = {}  # bytes → (sample index, read GB/s) per sample
        self.ariths: list[float] = []  # billions of multiply-adds per second, all threads
        self.syncs: list[float] = []  # microseconds per fork/join
        parallel_sum(self.buf[:16], 1)  # compiled (or loaded from cache) here, not in the first sample
        arith_chains(1, 1)
        fork_joins(np.zeros((1, 16)), 1)

    @property
    def nbytes(self) -> int:
        """The read buffer's bytes, all resident (filled when allocated): a benchmark's memory figure
        leaves them out."""
        return self.buf.nbytes

    def _read(self, n_bytes: int, n_threads: int) -> float:
        """Best-of-``reps`` read GB/s over the buffer's first ``n_bytes`` (the buffer grows to hold them)."""
        if n_bytes > self.buf.nbytes:
            self.buf = np.ones(-(-n_bytes // 4), np.float32)
        a = self.buf[: n_bytes // 4]
        return a.nbytes / _best_seconds(lambda: parallel_sum(a, n_threads), self.reps) / 1e9

    def sample(self, sizes: Iterable[int] = ()) -> tuple[float, float, float]:
        """Read GB/s, arithmetic G multiply-adds/s and fork/join µs now (also appended to
        :attr:`reads`, :attr:`ariths`, :attr:`syncs`). ``sizes``: byte counts to read as well (a
        benchmark's own working sets), kept in :attr:`sized`: a working set near the share of the L3
        the host leaves this guest reads from cache or from memory as the neighbours allow, which the
        main read, past that share, does not see (docs/decode.md, the twenty-seventh pass)."""
        sizes = sorted(set(sizes))
        if sizes and sizes[0] < 4:
            raise ValueError(f"a sized read needs at least 4 bytes, got {sizes[0]}")
        n = numba.get_num_threads()
        read = self._read(self.read_bytes, n)
        ops = n * self.arith_iters * ARITH_CHAINS
        arith = ops / _best_seconds(lambda: arith_chains(self.arith_iters, n), self.reps) / 1e9
        lines = np.zeros((n, 16))
        fork_joins(lines, 1)
        sync = 1e6 * _best_seconds(lambda: fork_joins(lines, self.sync_reps), self.reps) / self.sync_reps
        for size in sizes:
            self.sized.setdefault(size, []).append((len(self.reads), self._read(size, n)))
        self.reads.append(read)
        self.ariths.append(arith)
        self.syncs.append(sync)
        return read, arith, sync

    def spread(self, since: int = 0, size: int | None = None) -> MachineSpread | None:
        """The spreads of the samples from the ``since``-th on (None: no sample since), with the reads
        of ``size`` bytes among them where there are any."""
        if len(self.reads) <= since:
            return None
        own = [gbs for i, gbs in self.sized.get(size, ()) if i >= since] if size else []
        return MachineSpread(
            spread(self.reads[since:]), spread(self.ariths[since:]), spread(self.syncs[since:]),
            spread(own) if own else None, size if own else 0,
        )  # fmt: skip


def _layer() -> str:
    try:
        return numba.threading_layer()
    except ValueError:  # no parallel numba function has run yet
        return numba.config.THREADING_LAYER


def machine_line(bw: dict[str, Bandwidth]) -> str:
    """One line of context for the table: CPU, LLC, threads, bandwidths, OpenMP settings."""
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        model = next(
            (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.machine()
        )
    c = bw["cpu"]
    return (
        f"{model}, {os.cpu_count()} CPUs, LLC {llc_bytes() // MiB} MiB; threads numba {numba.get_num_threads()} "
        f"({_layer()}), torch {torch.get_num_threads()}; "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')} "
        f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '(unset)')}; numba-int path {IntAttn().resolved_path()}\n"
        f"bandwidth: copy {c.copy_gb_per_s:.1f} GB/s (torch copy_, 2 x bytes), read {c.read_gb_per_s:.1f} GB/s "
        "(numba sum); '% copy' = GB/s over the copy bandwidth"
        + "".join(f"; {d} copy {b.copy_gb_per_s:.0f} GB/s" for d, b in bw.items() if d != "cpu")
    )

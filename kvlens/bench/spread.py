"""How steady a benchmark's figure is: min / median / max over rounds, and a warning naming the
likely cause when the rounds disagree by more than a threshold.

A speed that moves from round to round is usually somebody else's: other processes on the machine
take cores from the benchmark's threads. The run therefore records how much CPU the *other*
processes used while it ran (psutil: the machine's busy CPU time less this process's and its reaped
children's, so a process that started and ended during the run counts too; per-process deltas name
the busiest still running) beside the 1-minute load average, so the warning can say which it was.
On a virtual machine the hypervisor can also run other guests on this guest's CPUs; Linux counts
that time as *steal* (``/proc/stat``), which no process of the guest sees, so the run records it
too.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

import psutil

WIDE_SPREAD = 0.10  # max/min - 1 above this prints a warning
BUSY_FRACTION = 0.25  # other processes using this share of the CPUs count as "other load"
STOLEN_FRACTION = 0.05  # steal above this share of the CPUs is named as the likely cause
SYNC_MOVED = 0.5  # a fork/join round trip that moves more than this moved with the machine (two dies: ~2.4x)


@dataclass(frozen=True)
class Spread:
    """Lowest, median and highest of a figure over rounds."""

    low: float
    median: float
    high: float

    @property
    def rel(self) -> float:
        """``high / low - 1``: 0.1 = the best round was 10% above the worst."""
        return self.high / self.low - 1 if self.low > 0 else float("inf")


@dataclass(frozen=True)
class MachineSpread:
    """The machine's own speed over a benchmark's rounds (:class:`.bandwidth.MachineProbe`): memory read
    bandwidth (GB/s), the cores' arithmetic rate (G multiply-adds/s, no memory access), the threads'
    fork/join round trip (µs) and, where sampled, the read bandwidth over the benchmark's own working
    set of ``own_bytes`` (GB/s). A benchmark figure that moves with one of them moved with the machine."""

    read: Spread
    arith: Spread
    sync: Spread
    own_read: Spread | None = None
    own_bytes: int = 0

    def moved(self, threshold: float) -> list[str]:
        """The probes whose spread is wider than ``threshold`` (the fork/join round trip: wider than
        :data:`SYNC_MOVED`, its own jitter being ~10 %), by name, the one furthest past its limit first."""
        named = [("its memory read bandwidth", self.read, threshold), ("its cores' arithmetic rate", self.arith, threshold),
                 ("its threads' fork/join round trip", self.sync, max(threshold, SYNC_MOVED))]  # fmt: skip
        if self.own_read is not None:
            own = f"its read bandwidth over the run's own {self.own_bytes / 1e6:.0f} MB"
            named.append((own, self.own_read, threshold))
        past = sorted((m.rel / limit, name) for name, m, limit in named if m.rel > limit)
        return [name for _, name in reversed(past)]

    def describe(self) -> str:
        """``memory read 33.3 GB/s (33.0–34.0, 3%), arithmetic …, fork/join …`` (median, min–max, spread),
        and the read over the run's own working set where sampled."""
        probes = [
            ("memory read", self.read, "GB/s"),
            ("arithmetic", self.arith, "G/s"),
            ("fork/join", self.sync, "µs"),
        ]
        return ", ".join(
            [_describe(n, m, u) for n, m, u in probes] + ([self.describe_own()] if self.own_read else [])
        )

    def describe_own(self) -> str:
        """``read of its own 163 MB 45.0 GB/s (38.1–46.2, 21%)``; empty where not sampled."""
        return (
            _describe(f"read of its own {self.own_bytes / 1e6:.0f} MB", self.own_read, "GB/s")
            if self.own_read
            else ""
        )


def _describe(name: str, m: Spread, unit: str) -> str:
    return f"{name} {m.median:.1f} {unit} ({m.low:.1f}–{m.high:.1f}, {m.rel:.0%})"


def machine_lines(labelled: dict[str, MachineSpread], sep: str = "; ") -> str:
    """The line(s) under a benchmark's table: each label's (a context, a shape) machine spread."""
    parts = sep.join(f"{label}: {m.describe()}" for label, m in labelled.items())
    return "machine between the rounds (median, min–max, spread): " + (parts or "not sampled")


def paired_ratio(a: list[float] | None, b: list[float] | None, unpaired: float) -> float:
    """The median over rounds of ``a[i] / b[i]``, two figures measured in the same interleaved rounds:
    each ratio compares measurements taken moments apart, so a machine whose speed drifts between
    rounds moves both alike. ``unpaired`` where the rounds do not pair (missing or of other counts)."""
    if not a or not b or len(a) != len(b):
        return unpaired
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def spread(values: list[float]) -> Spread:
    """The spread of ``values`` (one per round; at least one, all finite and positive)."""
    if not values:
        raise ValueError("spread of no rounds")
    if any(not (v > 0 and v < float("inf")) for v in values):
        raise ValueError(f"round figures must be finite and positive, got {values}")
    return Spread(min(values), statistics.median(values), max(values))


@dataclass
class OtherLoad:
    """CPU used by processes other than this one over an interval, and the 1-minute load average."""

    cpus: int
    load_avg_1m: float
    other_cpus: float  # CPUs' worth of time other processes used (1.0 = one core all along)
    top: list[tuple[str, float]] = field(default_factory=list)  # (name pid, CPUs' worth), busiest first
    steal_cpus: float = 0.0  # CPUs' worth of time the hypervisor gave other guests (Linux steal)


def _cpu_seconds() -> dict[int, tuple[str, float]]:
    out = {}
    me = os.getpid()
    for p in psutil.process_iter(["name", "cpu_times"]):
        t = p.info["cpu_times"]
        if p.pid != me and t is not None:
            out[p.pid] = (f"{p.info['name']} {p.pid}", t.user + t.system)
    return out


def _steal_seconds() -> float:
    """Machine-wide steal time so far (0 where the OS does not count it)."""
    return float(getattr(psutil.cpu_times(), "steal", 0.0))


def _busy_seconds() -> float:
    """Machine-wide CPU time not idle so far (user, nice, system, irq, softirq): every process's,
    those already gone included."""
    t = psutil.cpu_times()
    return sum(float(getattr(t, f, 0.0)) for f in ("user", "nice", "system", "irq", "softirq"))


def _own_seconds() -> float:
    """CPU time of this process and of its children that have ended (a benchmark's own helpers)."""
    t = psutil.Process().cpu_times()
    return t.user + t.system + t.children_user + t.children_system


GONE = "processes that ended during the run"  # their CPU, seen only in the machine-wide count


class LoadMeter:
    """Measures :class:`OtherLoad` between construction and :meth:`read`. The total is machine-wide
    (busy CPU time less this process's), so a process born and ended between the two readings counts
    too; the per-process readings name the busiest of those still running."""

    def __init__(self) -> None:
        self.t0, self.before, self.steal0 = time.monotonic(), _cpu_seconds(), _steal_seconds()
        self.busy0, self.own0 = _busy_seconds(), _own_seconds()

    def read(self, n_top: int = 3) -> OtherLoad:
        wall = max(time.monotonic() - self.t0, 1e-9)
        used = []
        for pid, (name, sec) in _cpu_seconds().items():
            prev = self.before.get(pid, (name, 0.0))[1]  # a process born during the run: all its time
            if sec > prev:
                used.append((name, (sec - prev) / wall))
        named = sum(u for _, u in used)
        machine = ((_busy_seconds() - self.busy0) - (_own_seconds() - self.own0)) / wall
        if machine - named >= 0.05:
            used.append((GONE, machine - named))
        used.sort(key=lambda x: -x[1])
        others, steal = max(named, machine), max(_steal_seconds() - self.steal0, 0.0) / wall
        return OtherLoad(psutil.cpu_count() or 1, os.getloadavg()[0], others, used[:n_top], steal)


def spread_warning(
    what: str,
    s: Spread,
    load: OtherLoad | None,
    threshold: float = WIDE_SPREAD,
    machine: MachineSpread | None = None,
) -> str | None:
    """A one-line warning when ``s`` is wider than ``threshold``, naming the likely cause; else None.
    ``machine``: the machine's own speed over the same rounds, when it was sampled."""
    if s.rel <= threshold:
        return None
    line = f"warning: {what} varies {s.rel:.0%} between rounds (max/min - 1 > {threshold:.0%}); "
    if load is None:
        return line + "the machine's load was not measured"
    busy = f"other processes used {load.other_cpus:.1f} of {load.cpus} CPUs during the run, load average {load.load_avg_1m:.1f}"
    top = ", ".join(f"{n} {c:.1f}" for n, c in load.top if c >= 0.05)
    busy += f", steal {load.steal_cpus:.2f} CPUs"
    if load.other_cpus >= BUSY_FRACTION * load.cpus:
        return line + f"likely cause: other load on the machine ({busy}{': ' + top if top else ''})"
    if load.steal_cpus >= STOLEN_FRACTION * load.cpus:
        return line + f"likely cause: the hypervisor ran other guests on this machine's CPUs ({busy})"
    line += f"no other load seen ({busy})"
    if machine is None:
        return line + ": the cause is in this process or the machine (frequency, memory)"
    moved = machine.moved(threshold)
    if moved:
        line += f": likely cause: the machine itself ({', '.join(moved)} moved)"
    else:
        line += ": the cause is in this process or a change of the machine its probes did not catch"
    return line + f"; the machine over the same rounds: {machine.describe()}"

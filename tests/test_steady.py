"""Steady speed: the spread over rounds and its warning (pure functions on given numbers), the thread
policy's environment defaults (the user's values win) and its one-thread runs. No timings."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import deque

import numba
import numpy as np
import pytest

from kvlens.bench.spread import MachineSpread, OtherLoad, Spread, spread, spread_warning
from kvlens.kernels import threads
from kvlens.kernels.probes import ARITH_CHAINS, arith_chains, fork_joins


def test_spread_min_median_max():
    s = spread([48.0, 36.0, 60.0, 40.0, 50.0])
    assert (s.low, s.median, s.high) == (36.0, 48.0, 60.0)
    assert s.rel == pytest.approx(60 / 36 - 1)  # the q8 runs: 36.0 .. 60.3 -> 67%
    assert spread([2.0, 1.0]).median == 1.5 and spread([5.0]).rel == 0.0


@pytest.mark.parametrize("bad", [[], [1.0, 0.0], [1.0, -2.0], [float("nan")], [1.0, float("inf")]])
def test_spread_rejects(bad):
    with pytest.raises(ValueError):
        spread(bad)


# the load average counts the benchmark's own threads too: 2.6 on 2 CPUs with others using 0.1 is idle
IDLE = OtherLoad(cpus=2, load_avg_1m=2.6, other_cpus=0.1, top=[("pytest 12", 0.1)])
BUSY = OtherLoad(cpus=2, load_avg_1m=11.4, other_cpus=1.3, top=[("pytest 12", 0.8), ("python 40", 0.5)])


def test_no_warning_within_threshold():
    assert spread_warning("q8 tok/s", Spread(40.0, 42.0, 43.9), BUSY) is None  # 9.75%
    assert spread_warning("q8 tok/s", Spread(40.0, 42.0, 49.0), BUSY, threshold=0.25) is None


def test_warning_names_other_load():
    line = spread_warning("q8 tok/s", Spread(40.0, 42.0, 44.5), BUSY)  # 11.25%
    assert line.startswith("warning: q8 tok/s varies 11% between rounds")
    assert "other load" in line and "1.3 of 2 CPUs" in line and "11.4" in line
    assert "pytest 12 0.8" in line and "python 40 0.5" in line


def test_warning_names_steal():
    """Time the hypervisor gave other guests (Linux steal) is named when no process of ours saw load."""
    stolen = OtherLoad(cpus=2, load_avg_1m=2.1, other_cpus=0.1, steal_cpus=0.4)
    line = spread_warning("q8 tok/s", Spread(30.0, 40.0, 45.0), stolen)
    assert "likely cause: the hypervisor" in line and "steal 0.40 CPUs" in line
    assert "no other load seen" not in line
    # below 5% of the CPUs steal is reported, not blamed
    little = OtherLoad(cpus=2, load_avg_1m=2.1, other_cpus=0.1, steal_cpus=0.09)
    line = spread_warning("q8 tok/s", Spread(30.0, 40.0, 45.0), little)
    assert "no other load seen" in line and "steal 0.09 CPUs" in line and "hypervisor" not in line
    # other processes' load wins over steal as the named cause
    both = OtherLoad(cpus=2, load_avg_1m=9.0, other_cpus=1.3, steal_cpus=0.4)
    assert "likely cause: other load" in spread_warning("q8 tok/s", Spread(30.0, 40.0, 45.0), both)


def test_load_meter_counts_steal(monkeypatch):
    """The meter's steal is the machine-wide steal delta over the wall time (CPUs' worth)."""
    import kvlens.bench.spread as sp

    clock, steal = iter([100.0, 102.0]), iter([50.0, 50.6])
    monkeypatch.setattr(sp.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(sp, "_steal_seconds", lambda: next(steal))
    monkeypatch.setattr(sp, "_cpu_seconds", dict)
    assert sp.LoadMeter().read().steal_cpus == pytest.approx(0.3)


def test_thresholds_are_inclusive_where_the_docs_say_so():
    """A spread of exactly the threshold is within it (WIDE_SPREAD: "above this prints a warning");
    other processes using exactly BUSY_FRACTION of the CPUs are other load ("this share ... count").
    1.25 / 1.0 - 1 and 0.25 * 2 are exact in binary floating point."""
    assert spread_warning("q8 tok/s", Spread(1.0, 1.1, 1.25), BUSY, threshold=0.25) is None
    at_share = OtherLoad(cpus=2, load_avg_1m=3.0, other_cpus=0.5)
    assert "likely cause: other load" in spread_warning("q8 tok/s", Spread(30.0, 40.0, 45.0), at_share)


def test_load_meter_counts_whole_lives_of_new_processes_busiest_first(monkeypatch):
    """A process born during the run counts with all its CPU time; an old one with its delta; the top
    list runs busiest first."""
    import kvlens.bench.spread as sp

    clock = iter([100.0, 104.0])
    before = {1: ("old 1", 10.0), 2: ("steady 2", 5.0)}
    after = {1: ("old 1", 11.0), 2: ("steady 2", 5.0), 3: ("new 3", 2.0), 4: ("busy 4", 3.0)}
    seconds = iter([before, after])
    monkeypatch.setattr(sp.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(sp, "_steal_seconds", lambda: 0.0)
    monkeypatch.setattr(sp, "_cpu_seconds", lambda: next(seconds))
    load = sp.LoadMeter().read()
    assert load.other_cpus == pytest.approx((1.0 + 2.0 + 3.0) / 4)
    assert load.top == [("busy 4", 0.75), ("new 3", 0.5), ("old 1", 0.25)]


def test_warning_without_other_load_points_inside():
    line = spread_warning("f16 tok/s", Spread(36.0, 47.4, 60.3), IDLE)
    assert "67%" in line and "no other load seen" in line and "other load on the machine" not in line
    assert "the cause is in this process or the machine" in line
    assert "not measured" in spread_warning("f16 tok/s", Spread(36.0, 47.4, 60.3), None)


FLAT = Spread(10.0, 10.2, 10.5)  # 5%: within the 10% threshold


def test_the_read_of_the_runs_own_bytes_is_a_probe_too_and_the_furthest_moved_comes_first():
    """The read over the run's own working set is named when it moved, beside the others, the probe
    furthest past its limit first (the fork/join trip's limit being 50 %), and quoted in every line."""
    own = Spread(36.0, 44.0, 48.6)  # 35 %
    machine = MachineSpread(
        FLAT, Spread(8.0, 8.5, 9.2), Spread(1.1, 1.2, 2.0), own, 163_000_000
    )  # 15 %, 82 %
    line = spread_warning("q8 tok/s", Spread(36.0, 47.4, 49.0), IDLE, machine=machine)
    cause = line.split("likely cause: the machine itself (")[1].split(" moved)")[0]
    assert cause == (
        "its read bandwidth over the run's own 163 MB, its threads' fork/join round trip, its cores' arithmetic rate"
    )
    assert line.endswith(f"; the machine over the same rounds: {machine.describe()}")
    assert machine.describe().endswith(", read of its own 163 MB 44.0 GB/s (36.0–48.6, 35%)")
    assert MachineSpread(FLAT, FLAT, FLAT, Spread(40.0, 41.0, 43.9), 163_000_000).moved(0.10) == []
    assert MachineSpread(FLAT, FLAT, FLAT).describe_own() == ""


@pytest.mark.parametrize(
    "read,arith,sync,named",
    [
        (FLAT, FLAT, FLAT, []),
        (Spread(22.0, 25.0, 27.5), FLAT, FLAT, ["its memory read bandwidth"]),
        (FLAT, Spread(8.0, 8.5, 9.2), FLAT, ["its cores' arithmetic rate"]),
        (FLAT, FLAT, Spread(1.1, 1.2, 2.7), ["its threads' fork/join round trip"]),
        (FLAT, FLAT, Spread(1.1, 1.2, 1.5), []),  # 36%: within the fork/join probe's own jitter bound
        (
            Spread(30.0, 40.0, 55.0),
            FLAT,
            Spread(1.1, 2.0, 2.7),
            ["its memory read bandwidth", "its threads'"],
        ),
    ],
)
def test_warning_names_the_machine_probes_that_moved(read, arith, sync, named):
    """A probe that moved more than the threshold over the same rounds is named as the likely cause;
    with none, the warning says the probes saw nothing; every probe's figures are quoted either way."""
    machine = MachineSpread(read, arith, sync)
    line = spread_warning("f16 tok/s", Spread(36.0, 47.4, 60.3), IDLE, machine=machine)
    assert line.startswith("warning: f16 tok/s varies 67% between rounds") and "no other load seen" in line
    if named:
        cause = line.split("likely cause: the machine itself (")[1].split(" moved)")[0]
        assert [n for n in named if n in cause] == named and cause.count("its ") == len(named)
    else:
        assert "likely cause" not in line and "a change of the machine its probes did not catch" in line
    assert line.endswith(f"; the machine over the same rounds: {machine.describe()}")
    assert f"memory read {read.median:.1f} GB/s ({read.low:.1f}–{read.high:.1f}, {read.rel:.0%})" in line
    assert f"fork/join {sync.median:.1f} µs ({sync.low:.1f}–{sync.high:.1f}, {sync.rel:.0%})" in line
    assert f"arithmetic {arith.median:.1f} G/s ({arith.low:.1f}–{arith.high:.1f}" in line


@pytest.mark.parametrize("n_threads,reps", [(1, 1), (2, 5), (3, 7)])
def test_fork_join_probe_runs_every_region_on_every_row(n_threads, reps):
    lines = np.zeros((n_threads, 16))
    fork_joins(lines, reps)
    expected = np.zeros((n_threads, 16))
    expected[:, 0] = reps
    assert np.array_equal(lines, expected)


@pytest.mark.parametrize("n_iter,n_chunks", [(0, 1), (1, 2), (37, 3)])
def test_arith_probe_runs_every_chain_step(n_iter, n_chunks):
    """The arithmetic probe's chains, step by step in float32 (no reassociation: each chain's value is
    exactly that of its own recurrence, so the compiler cannot have folded the work away)."""
    m, b = np.float32(0.999), np.float32(1e-3)
    total = np.float32(0.0)
    for c in range(n_chunks):
        a = np.full(ARITH_CHAINS, c, np.float32)
        for _ in range(n_iter):
            a = a * m + b
        part = a[0]
        for x in a[1:]:  # the kernel's order: a0 + a1 + ... + a7, then the parts in turn
            part = part + x
        total = total + part
    assert arith_chains(n_iter, n_chunks) == total


def test_env_defaults_keep_user_values():
    env = {"OMP_WAIT_POLICY": "ACTIVE", "PATH": "/bin"}
    added = threads.apply_env_defaults(env)
    assert env["OMP_WAIT_POLICY"] == "ACTIVE"  # the user's
    assert added == {"GOMP_SPINCOUNT": threads.ENV_DEFAULTS["GOMP_SPINCOUNT"]}
    assert env["GOMP_SPINCOUNT"] == threads.ENV_DEFAULTS["GOMP_SPINCOUNT"] and env["PATH"] == "/bin"
    empty: dict[str, str] = {}
    assert threads.apply_env_defaults(empty) == threads.ENV_DEFAULTS == empty


def test_import_keeps_user_env():
    """``import kvlens`` sets the defaults before torch loads, and never over the user's values."""
    code = "import os, kvlens; print(os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'])"
    env = {k: v for k, v in os.environ.items() if k not in threads.ENV_DEFAULTS}
    env["GOMP_SPINCOUNT"] = "7"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [threads.ENV_DEFAULTS["OMP_WAIT_POLICY"], "7"]


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs two numba threads")
def test_set_threads_sets_both(monkeypatch):
    import torch

    monkeypatch.setattr(threads, "_user_count", threads._user_count)  # restored afterwards
    before = torch.get_num_threads()
    try:
        threads.set_threads(1)
        assert numba.get_num_threads() == torch.get_num_threads() == 1
        threads.set_threads(None)  # leaves both alone
        assert numba.get_num_threads() == torch.get_num_threads() == 1
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        torch.set_num_threads(before)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs two numba threads")
def test_run_serial_if_one_thread_then_restores():
    numba.set_num_threads(2)
    try:
        assert threads.run_serial_if(True, numba.get_num_threads) == 1
        assert threads.run_serial_if(False, numba.get_num_threads) == 2
        with pytest.raises(ZeroDivisionError):
            threads.run_serial_if(True, lambda: 1 / 0)
        assert numba.get_num_threads() == 2  # restored after an error too
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def _loadavg(running: int) -> str:
    return f"1.9 1.9 1.9 {running}/380 4242"


def test_others_running_subtracts_own_threads():
    calls = []

    def own() -> int:
        calls.append(1)
        return 3

    assert threads.others_running(lambda: _loadavg(1), own) == 0 and not calls  # only us: not asked
    assert threads.others_running(lambda: _loadavg(7), own) == 4 and calls
    assert threads.others_running(lambda: _loadavg(2), lambda: 2) == 0  # our two threads only


def test_others_running_does_not_count_our_threads_that_fall_asleep():
    """Between two parallel regions our worker threads only fall asleep: one that still spun when the
    load was first read and sleeps by the time we count our own must not pass for another process
    (it did: a quiet box ran a few percent of its decode steps on one thread)."""
    awake = {"workers": 1}  # the main thread runs throughout; one worker still spins

    def read() -> str:
        text = _loadavg(1 + awake["workers"])
        awake["workers"] = 0  # and falls asleep right after the first read
        return text

    assert threads.others_running(read, lambda: 1 + awake["workers"]) == 0


def test_steady_others_ignores_a_one_step_blip_but_not_a_neighbour():
    recent = deque([0, 0], maxlen=threads.RECENT_STEPS)
    assert [threads.steady_others(o, recent) for o in (1, 0, 0)] == [0, 0, 0]  # a task ran for a moment
    held = [threads.steady_others(o, recent) for o in (1, 1, 1, 0, 1, 0, 1, 0, 0)]
    # a neighbour holding a core: from its second reading on, while it is caught in two of three steps
    assert held == [0, 1, 1, 1, 1, 0, 1, 0, 0]


@pytest.mark.parametrize(
    ("threads_", "cpus", "others", "want"),
    [(2, 2, 0, 2), (2, 2, 1, 1), (2, 2, 9, 1), (8, 16, 10, 6), (4, 16, 3, 4), (1, 2, 0, 1)],
)
def test_step_threads(threads_, cpus, others, want):
    assert threads.step_threads(threads_, cpus, others) == want


def busy_machine(monkeypatch) -> None:
    """Other tasks hold as many CPUs as this process may use (a fixed count such as 40 is not busy on
    a runner with 42 or more CPUs), in this and the recent steps."""
    busy = len(os.sched_getaffinity(0))
    monkeypatch.setattr(threads, "others_running", lambda read, own: busy)
    monkeypatch.setattr(threads, "_recent_others", deque([busy, busy], maxlen=threads.RECENT_STEPS))


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs two numba threads")
def test_decode_threads_keeps_a_count_the_user_fixed(monkeypatch):
    """A thread count the user set (env, ``--threads``) holds on a busy machine too; otherwise a step
    runs on the CPUs left free (here: other tasks hold every CPU this process may use)."""
    busy_machine(monkeypatch)
    numba.set_num_threads(2)
    try:
        monkeypatch.setattr(threads, "_user_count", True)
        with threads.decode_threads() as n:
            assert n == numba.get_num_threads() == 2
        monkeypatch.setattr(threads, "_user_count", False)
        with threads.decode_threads() as n:
            assert n == numba.get_num_threads() == 1
        assert numba.get_num_threads() == 2  # restored after the step
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def test_user_thread_env_fixes_the_count():
    code = "import kvlens.kernels.threads as t; print(t._user_count)"
    env = {k: v for k, v in os.environ.items() if k not in threads.THREADS_ENV}
    run = [sys.executable, "-c", code]
    assert subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout.strip() == "False"
    env["OMP_NUM_THREADS"] = "2"
    assert subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout.strip() == "True"


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs two numba threads")
def test_busy_step_gives_the_same_attention_bits(monkeypatch):
    """A decode step on fewer threads divides the sequence for the same count (split_threads), so its
    attention output is bit-identical to a quiet step's: results never depend on the machine's load."""
    import torch

    from kvlens.kernels.cpu import decode_attention
    from kvlens.kv.kinds import StoreKind
    from kvlens.kv.stores import RowStore

    rng = np.random.default_rng(0)
    n_heads, n_kv, hd, ctx = 9, 3, 64, 1500  # above the serial size: split over threads
    q = torch.from_numpy(rng.standard_normal((n_heads, hd), dtype=np.float32))
    k, v = (RowStore.empty(StoreKind.Q8, n_kv, ctx, hd, torch.device("cpu")) for _ in range(2))
    for store in (k, v):
        store.data.copy_(torch.from_numpy(rng.integers(-127, 128, (n_kv, ctx, hd), dtype=np.int8)))
        store.scale.copy_(torch.from_numpy(rng.random((n_kv, ctx), dtype=np.float32)))
    numba.set_num_threads(2)
    try:
        quiet = decode_attention(q, k, v, ctx)
        monkeypatch.setattr(threads, "_user_count", False)
        busy_machine(monkeypatch)
        with threads.decode_threads() as n:
            assert n == 1 and threads.split_threads() == 2
            busy = decode_attention(q, k, v, ctx)
        assert threads.split_threads() == 2
        assert torch.equal(busy, quiet)
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)

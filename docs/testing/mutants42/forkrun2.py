"""Give each listed mutant its verdict: run the tests that reach it (from mutmut's own record) in a
child forked from a warm, one-thread parent, and print CAUGHT (a test failed or errored), SURVIVED
(every test passed), HUNG (killed after its time) or CRASHED (a signal).

Why not mutmut's own verdicts: in this project about 1,400 of its runs ended by SIGTERM (exit -15,
"suspicious"). The fortieth session found why: numba's GNU OpenMP threading layer, called in a child
forked from a process that has already run a parallel region, prints "Terminating: fork() called
from a process already using GNU OpenMP, this is unsafe." and raises SIGTERM on itself (gdb: the
``raise`` comes from a parallel numba kernel). mutmut's parent runs the tests once before it forks,
so every child that reached a parallel kernel died. With ``NUMBA_THREADING_LAYER=workqueue`` and one
OpenMP thread (``OMP_NUM_THREADS=1``: torch's own pool hangs in a forked child otherwise, see
docs/testing.md, "Fork") mutmut's verdicts are sound again. This runner forks from a parent that has imported, but not run,
anything parallel, and reads pytest's own exit code.
Run it in the folder that holds ``mutants/`` (after ``mutmut run``), one mutant name a line:

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python forkrun.py names.txt > verdicts.txt

With ``FORKRUN_TESTS="tests/a.py tests/b.py"`` every mutant runs those test files instead (tests
written after mutmut recorded which tests reach what; copy them into ``mutants/tests`` first).
"""

import json
import os
import signal
import sys
import time

os.chdir("mutants")
sys.path.insert(0, os.getcwd())

import pytest  # noqa: E402
import torch  # noqa: E402, F401  (warm: imported once, before the forks)

import kvlens  # noqa: E402, F401

CHILDREN = 2


def covering_tests(stats: dict, mutant: str) -> list[str]:
    if os.environ.get("FORKRUN_TESTS"):
        return os.environ["FORKRUN_TESTS"].split()
    mangled = mutant.rsplit("__mutmut_", 1)[0]
    tests = stats["tests_by_mangled_function_name"].get(mangled, [])
    return sorted(tests, key=lambda t: stats["duration_by_test"].get(t, 0.0))  # fast ones first


def start(mutant: str, tests: list[str]) -> int:
    pid = os.fork()
    if pid == 0:
        os.environ["MUTANT_UNDER_TEST"] = mutant
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        # a base temp of its own, so no two children (nor their cleanups) share pytest's numbered temp
        # folders: one mutant's verdict never depends on what another child did to the disk
        basetemp = f"/tmp/forkrun-{os.getpid()}"
        junit = f"/tmp/mut42/jx/{mutant}.xml"
        code = pytest.main(
            ["-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist", f"--basetemp={basetemp}",
             f"--junitxml={junit}", *tests]
        )
        os._exit(int(code))
    return pid


def first_failure(mutant: str) -> str:
    """The file of the first test that failed (from the child's junit XML), or "-"."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(f"/tmp/mut42/jx/{mutant}.xml").getroot()
    except (OSError, ET.ParseError):
        return "-"
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            return case.get("classname", "?") + "::" + case.get("name", "?")
    return "-"


def verdict(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return "SURVIVED"
    if code in (1, 3):
        return "CAUGHT"
    return f"CRASHED ({code})" if code < 0 else f"OTHER (pytest exit {code})"


def main() -> None:
    names = [n for n in open(sys.argv[1]).read().split() if n]
    stats = json.load(open("mutmut-stats.json"))
    running: dict[int, tuple[str, float]] = {}
    queue = list(names)
    while queue or running:
        while queue and len(running) < CHILDREN:
            mutant = queue.pop(0)
            tests = covering_tests(stats, mutant)
            if not tests:
                print(mutant, "NO TEST REACHES IT", flush=True)
                continue
            budget = 60 + 20 * sum(stats["duration_by_test"].get(t, 0.0) for t in tests)
            running[start(mutant, tests)] = (mutant, time.monotonic() + budget)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            name = running.pop(pid)[0]
            print(name, verdict(status), first_failure(name), flush=True)
            continue
        for pid, (_, deadline) in list(running.items()):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                print(running.pop(pid)[0], "HUNG", flush=True)
        time.sleep(0.05)


if __name__ == "__main__":
    main()

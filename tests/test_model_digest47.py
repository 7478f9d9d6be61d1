"""An HF model directory's digest (the sweep's recorded input, the disk tier's model key, `verify`'s
record) and stamp (kept-loaded models) cover the files the loader reads, not a clone's or a download's
hidden bookkeeping (``.git``, ``.cache/huggingface``), which git and the hub rewrite on their own: a
`git fetch` in the model's directory made a resumed sweep refuse the model as changed."""

from __future__ import annotations

import hashlib

from test_model_stamp46 import hf_dir

from kvlens.models.loader import file_digest, model_stamp


def test_hidden_files_and_folders_are_not_the_model(tmp_path):
    d = hf_dir(tmp_path)
    digest, stamp = file_digest(d), model_stamp(d)
    for hidden in [
        ".git/HEAD",
        ".git/lfs/objects/ab/cd",
        ".cache/huggingface/download/a.metadata",
        ".gitattributes",
    ]:
        (d / hidden).parent.mkdir(parents=True, exist_ok=True)
        (d / hidden).write_text("ref: refs/heads/main\n")
    (d / "sub" / ".hidden").write_text("x")
    assert file_digest(d) == digest and model_stamp(d) == stamp
    (d / "tokenizer.json").write_text("{}")  # a file the loader reads is part of the model
    assert file_digest(d) != digest and len(model_stamp(d)) == len(stamp) + 1


def test_the_digest_is_each_file_by_name_and_content(tmp_path):
    """Independent of the walk: the listing of ``relative name NUL sha256`` lines, sorted by path."""
    d = hf_dir(tmp_path)
    (d / ".git").mkdir()
    (d / ".git" / "config").write_text("[core]\n")
    lines = [
        f"{n}\0{hashlib.sha256(b).hexdigest()}\n"
        for n, b in [("config.json", b"{}"), ("sub/a.safetensors", b"xy")]
    ]
    assert file_digest(d) == hashlib.sha256("".join(lines).encode()).hexdigest()
    (d / "sub" / "a.safetensors").write_bytes(b"xz")
    assert file_digest(d) != hashlib.sha256("".join(lines).encode()).hexdigest()

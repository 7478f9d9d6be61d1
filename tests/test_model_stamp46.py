"""Models the lab keeps loaded in a process are keyed by their files' stamp (loader.model_stamp), so a
file replaced at the same path is loaded anew: `lab unit --dist real` called again in one process
measured the first file's weights before."""

from __future__ import annotations

import os
import shutil

from test_sweep import EXCERPT
from tiny_models import write_gguf, write_hf

from kvlens.lab import unit
from kvlens.lab.unit import UnitConfig
from kvlens.models.loader import model_stamp


def hf_dir(tmp_path):
    """A model directory of two files, one in a subfolder."""
    d = tmp_path / "hf"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "sub" / "a.safetensors").write_bytes(b"xy")
    return d


def test_the_stamp_follows_each_file(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"1234")
    st = f.stat()
    assert model_stamp(f) == model_stamp(str(f)) == ((str(f), 4, st.st_mtime_ns, st.st_ino),)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # the same bytes, written again
    assert model_stamp(f) != ((str(f), 4, st.st_mtime_ns, st.st_ino),)
    d = hf_dir(tmp_path)
    assert [row[:2] for row in model_stamp(d)] == [
        (str(d / "config.json"), 2),
        (str(d / "sub" / "a.safetensors"), 2),
    ]
    assert model_stamp("smollm2") == ("smollm2",) and model_stamp(tmp_path / "gone") == (
        str(tmp_path / "gone"),
    )


def test_lab_unit_reloads_a_model_replaced_at_its_path(tmp_path, monkeypatch):
    monkeypatch.setattr(unit, "_LLMS", {})
    model = write_gguf(write_hf("qwen2", tmp_path / "hf0", seed=0), "qwen2", tmp_path / "tiny.gguf")
    shutil.copy(EXCERPT, tmp_path / "t.txt")
    cfg = UnitConfig(dist="real", model=str(model), text=str(tmp_path / "t.txt"), seq_len=[16], layer=1)
    first = unit.RealSource(cfg)
    assert unit.RealSource(cfg).llm is first.llm  # kept loaded while the file is the same
    write_gguf(write_hf("qwen2", tmp_path / "hf1", seed=1), "qwen2", model)
    again = unit.RealSource(cfg)
    assert again.llm is not first.llm
    k0, k1 = first.get(16, 0)[1], again.get(16, 0)[1]
    assert not bool((k0 == k1).all())

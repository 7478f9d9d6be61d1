"""An HF model directory that is a git clone: does `git fetch`-style bookkeeping change the model's digest
(the sweep's recorded input, the disk tier's model key) and stamp? Run:
PYTHONPATH=tests .venv/bin/python docs/testing/probe47/hf_git_digest.py
"""

import tempfile
from pathlib import Path

from tiny_models import write_hf

from kvlens.models.loader import file_digest, model_stamp

with tempfile.TemporaryDirectory() as tmp:
    d = Path(tmp) / "hf"
    write_hf("llama", d, seed=0)
    before = file_digest(d), len(model_stamp(d))
    (d / ".git").mkdir()
    (d / ".git" / "FETCH_HEAD").write_text("0123abcd\tbranch 'main' of https://huggingface.co/x/y\n")
    after = file_digest(d), len(model_stamp(d))
    print(f"digest {before[0][:12]} -> {after[0][:12]}: {'changed' if before[0] != after[0] else 'unchanged'}")
    print(f"stamp files {before[1]} -> {after[1]}")

"""Before/after probe of the forty-fifth session: a llama GGUF whose header says it is a mixture of
experts (`llama.expert_count`, as in Mixtral's files). llama.cpp then builds its llama graph with
experts and needs their tensors; this tiny file holds dense ones. Run from the repository root:
    PYTHONPATH=tests .venv/bin/python docs/testing/probe45/experts.py
"""

import tempfile
from pathlib import Path

import gguf
from test_bad_input_models import rewrite_gguf
from tiny_models import write_gguf, write_hf

import kvlens

root = Path(tempfile.mkdtemp())
model = write_hf("mistral", root / "hf")
dense = write_gguf(model, "mistral", root / "dense.gguf")
for n in (0, 8):
    meta = {
        "llama.expert_count": (n, gguf.GGUFValueType.UINT32),
        "llama.expert_used_count": (min(n, 2), gguf.GGUFValueType.UINT32),
    }
    path = rewrite_gguf(dense, root / f"e{n}.gguf", meta=meta)
    try:
        kvlens.load(str(path))
        print(f"llama.expert_count = {n}: loads, runs as a dense model")
    except Exception as e:  # what a user would see
        print(f"llama.expert_count = {n}: refused: {e}")

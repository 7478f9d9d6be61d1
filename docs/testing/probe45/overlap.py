"""Before/after probe of the forty-fifth session: a GGUF whose tensor `blk.0.ffn_norm.weight` states
the data offset of `blk.0.attn_norm.weight` (so the two share bytes), patched from a valid tiny file.
ggml's `gguf_init_from_file` refuses such a layout. Run from the repository root:
    PYTHONPATH=tests .venv/bin/python docs/testing/probe45/overlap.py
"""

import tempfile
from pathlib import Path

import gguf
from tiny_models import write_gguf, write_hf

from kvlens.models.loader import load_model

root = Path(tempfile.mkdtemp())
ok = write_gguf(write_hf("mistral", root / "hf"), "mistral", root / "ok.gguf")
reader = gguf.GGUFReader(ok)
tensors = {t.name: t for t in reader.tensors}
source, target = tensors["blk.0.attn_norm.weight"], tensors["blk.0.ffn_norm.weight"]
where = target.field.offset + sum(p.nbytes for p in target.field.parts[:-1])  # the offset is last
raw = bytearray(ok.read_bytes())
raw[where : where + 8] = (source.data_offset - reader.data_offset).to_bytes(8, "little")
bad = root / "overlap.gguf"
bad.write_bytes(bytes(raw))
try:
    layer = load_model(bad).weights.layers[0]
    print(
        f"loads; layer 0's MLP norm equals its attention norm: {bool((layer.ffn_norm == layer.attn_norm).all())}"
    )
except Exception as e:  # what a user would see
    print(f"refused: {e}")

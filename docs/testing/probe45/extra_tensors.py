"""Before/after probe of the forty-fifth session: tensors a model file holds beyond its config.

Writes tiny Mistral (GGUF arch llama) and Qwen3 models with transformers, adds one tensor to each file
and loads it with kvlens; prints whether it loads and, if so, how far its logits move from the
file without the tensor (max |Δ| over 12 positions). Run from the repository root:
    PYTHONPATH=tests .venv/bin/python docs/testing/probe45/extra_tensors.py
"""

import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from test_bad_input_models import rewrite_gguf
from tiny_models import write_gguf, write_hf

import kvlens

IDS = [5, 17, 99, 3, 250, 42, 7, 300, 11, 64, 128, 9]


def logits(path: Path) -> torch.Tensor:
    return kvlens.load(str(path)).logits(IDS)


def report(label: str, plain: Path, extra: Path) -> None:
    try:
        moved = (logits(extra) - logits(plain)).abs().max().item()
        print(f"{label}: loads; logits move by {moved:.3g}")
    except Exception as e:  # the probe reports what a user would see
        print(f"{label}: refused: {e}")


root = Path(tempfile.mkdtemp())
for arch in ("mistral", "qwen3"):
    model = write_hf(arch, root / arch)
    gguf = write_gguf(model, arch, root / f"{arch}.gguf")
    head_dim = (
        getattr(model.config, "head_dim", None)
        or model.config.hidden_size // model.config.num_attention_heads
    )
    FREQS = np.linspace(1.0, 4.0, head_dim // 2, dtype=np.float32)  # one factor per frequency, none 1
    for name in ("rope_freqs.weight", "blk.0.rotary_emb.inv_freq"):
        extra = rewrite_gguf(gguf, root / f"{arch}-x.gguf", tensors={name: FREQS})
        report(f"{arch} GGUF + {name}", gguf, extra)
    hf = root / f"{arch}-hf"
    hf.mkdir()
    for f in (root / arch).iterdir():
        if f.name != "model.safetensors.index.json":
            (hf / f.name).write_bytes(f.read_bytes())
    shard = sorted(hf.glob("*.safetensors"))[0]
    save_file(load_file(shard) | {"rope_freqs": torch.from_numpy(FREQS)}, shard)
    report(f"{arch} HF directory + rope_freqs", root / arch, hf)

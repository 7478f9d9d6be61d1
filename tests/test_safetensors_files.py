"""Which safetensors files of an HF directory kvlens reads: those transformers reads, in its order
(``model.safetensors`` alone where it is there, else the shards the index names). kvlens read every
``*.safetensors`` in the directory, so a stray copy beside the model (a backup, another export) could
replace its tensors without a word: the file sorted last won. Without either, kvlens still reads every
file, and a tensor found in two of them is refused."""

from __future__ import annotations

import json

import pytest
import torch
from bounds import f32_forward_tol
from safetensors.torch import load_file, save_file
from test_models import IDS, float64_logits
from test_tied_head_conflict import hf_logits
from tiny_models import write_hf

import kvlens
from kvlens.models.config import ModelLoadError

META = {"format": "pt"}


def tensors_of(path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        out |= load_file(path / shard)
    return out


def perturbed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
        for k, v in tensors.items()
    }


def close(path, ref) -> bool:
    llm = kvlens.load(path, kv="f32", attn_backend="torch")
    return (llm.logits(IDS).double() - ref).abs().max().item() <= f32_forward_tol(llm.config, ref)


def test_model_safetensors_alone_is_read_beside_a_stray_copy(tmp_path):
    hf = write_hf("llama", tmp_path)
    tensors = tensors_of(tmp_path)
    for f in [*tmp_path.glob("*.safetensors"), tmp_path / "model.safetensors.index.json"]:
        f.unlink()
    save_file(tensors, tmp_path / "model.safetensors", metadata=META)
    save_file(perturbed(tensors), tmp_path / "model_backup.safetensors", metadata=META)  # sorts last
    ref = hf_logits(tmp_path)
    assert torch.allclose(ref, float64_logits(hf, IDS), rtol=0, atol=1e-12)  # transformers: the model's own
    assert close(tmp_path, ref)


def test_model_safetensors_wins_over_an_index(tmp_path):
    """transformers looks for model.safetensors first; the shards beside it are another export."""
    write_hf("llama", tmp_path)
    save_file(perturbed(tensors_of(tmp_path)), tmp_path / "model.safetensors", metadata=META)
    ref = hf_logits(tmp_path)
    assert close(tmp_path, ref)


def test_without_an_index_a_tensor_in_two_files_is_refused(tmp_path):
    write_hf("llama", tmp_path)
    tensors = tensors_of(tmp_path)
    for f in [*tmp_path.glob("*.safetensors"), tmp_path / "model.safetensors.index.json"]:
        f.unlink()
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[::2]}, tmp_path / "a.safetensors", metadata=META)
    save_file({k: tensors[k] for k in names[1::2]}, tmp_path / "b.safetensors", metadata=META)
    kvlens.load(tmp_path, kv="f32")  # two files, each tensor once: the union
    save_file({names[0]: tensors[names[0]]}, tmp_path / "c.safetensors", metadata=META)
    with pytest.raises(
        ModelLoadError, match=rf"tensor '{names[0]}' is in two files of .*, a.safetensors and c"
    ):
        kvlens.load(tmp_path, kv="f32")

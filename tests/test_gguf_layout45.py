"""A GGUF file's tensor data laid out as ggml requires (``gguf_init_from_file``): each tensor starts
where the one before it ends, padded to the file's alignment, and llama.cpp refuses any other layout.
The gguf package reads whatever offset a tensor states, so until the forty-fifth session a file whose
``blk.0.ffn_norm.weight`` pointed at ``blk.0.attn_norm.weight``'s bytes loaded, and ran with the wrong
norm. The files here are patched byte by byte from a valid one."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from tiny_models import write_gguf, write_hf, write_out

from kvlens.models.config import ModelLoadError
from kvlens.models.gguf_loader import open_gguf
from kvlens.models.loader import load_model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("layout")
    return write_gguf(write_hf("mistral", root / "hf"), "mistral", root / "ok.gguf")


def _with_offset(src: Path, dst: Path, name: str, offset: int) -> Path:
    """A copy of ``src`` whose tensor ``name`` states data offset ``offset`` (relative to the data)."""
    tensor = next(t for t in gguf.GGUFReader(src).tensors if t.name == name)
    where = tensor.field.offset + sum(p.nbytes for p in tensor.field.parts[:-1])  # the offset is last
    raw = bytearray(src.read_bytes())
    raw[where : where + 8] = offset.to_bytes(8, "little")
    dst.write_bytes(bytes(raw))
    return dst


def _offsets(path: Path) -> dict[str, int]:
    reader = gguf.GGUFReader(path)
    return {t.name: t.data_offset - reader.data_offset for t in reader.tensors}


def test_a_tensor_that_shares_another_ones_bytes_is_refused(tiny_gguf, tmp_path):
    offsets = _offsets(tiny_gguf)
    bad = _with_offset(
        tiny_gguf, tmp_path / "b.gguf", "blk.0.ffn_norm.weight", offsets["blk.0.attn_norm.weight"]
    )
    with pytest.raises(ModelLoadError) as e:
        load_model(bad)
    want_end = offsets["blk.0.ffn_norm.weight"]  # where the tensors before it end: its own true offset
    assert str(e.value) == (
        f"cannot read GGUF file {bad}: tensor 'blk.0.ffn_norm.weight' has its data at offset "
        f"{offsets['blk.0.attn_norm.weight']}, where the tensors before it end at {want_end} "
        "(overlapping or misplaced tensor data)"
    )


def test_a_gap_before_a_tensor_is_refused(tiny_gguf, tmp_path):
    first = next(iter(_offsets(tiny_gguf)))
    bad = _with_offset(tiny_gguf, tmp_path / "g.gguf", first, 32)  # one alignment step late
    with pytest.raises(
        ModelLoadError,
        match=f"tensor '{first}' has its data at offset 32, where the tensors before it end at 0",
    ):
        open_gguf(bad)


def test_the_valid_layout_is_read(tiny_gguf):
    offsets = list(_offsets(tiny_gguf).values())
    assert offsets[0] == 0 and offsets == sorted(offsets)
    reader, _ = open_gguf(tiny_gguf)
    assert len(reader.tensors) == len(offsets)


def test_each_tensor_is_padded_to_the_alignment(tmp_path):
    """Tensors of 12 and 40 bytes: the next one starts at 32, then 96 (alignment 32), as the writer
    pads them; with an alignment of 64 stated in the file, at 64 and 128."""
    for alignment, want in ((None, [0, 32, 96]), (64, [0, 64, 128])):
        path = tmp_path / f"pad{alignment}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        if alignment is not None:
            w.add_custom_alignment(alignment)
        for name, n in (("a", 3), ("b", 10), ("c", 4)):
            w.add_tensor(name, np.zeros(n, np.float32))
        write_out(w)
        reader, _ = open_gguf(path)
        assert [t.data_offset - reader.data_offset for t in reader.tensors] == want

"""A GGUF header's refusals name the file they read and the key at fault, in the words a user can act
on: the RoPE dimension count that differs from the head size (kvlens rotates whole heads), a file that
states its vocabulary neither as a size nor as a token list, and the keys read through the shared shape
reader. The forty-third session's mutation run found these unasserted (docs/testing.md)."""

from __future__ import annotations

import pytest
from test_bad_input_models import DROP, GT, refused, rewrite_gguf, tiny  # noqa: F401

TINY_MODEL = ("mistral", 2)  # test_bad_input_models' tiny: a 2-layer Mistral saved as arch "llama"


@pytest.mark.parametrize(
    "meta, words",
    [
        ({"llama.rope.dimension_count": (8, GT.UINT32)}, "llama.rope.dimension_count=8 differs from the head size 16; unsupported"),
        ({"llama.attention.value_length": (8, GT.UINT32)}, "llama.attention.value_length=8 differs from the head size 16; unsupported"),
        ({"llama.attention.value_length": (0, GT.UINT32)}, "llama.attention.value_length must be ≥ 1, got 0"),
        ({"llama.block_count": (0, GT.UINT32)}, "llama.block_count must be ≥ 1, got 0"),
        (
            {
                "llama.attention.key_length": DROP, "llama.attention.value_length": DROP,
                "llama.attention.head_count": (3, GT.UINT32), "llama.attention.head_count_kv": (3, GT.UINT32),
            },
            "llama.embedding_length=64 is not a multiple of llama.attention.head_count=3",
        ),
        ({"llama.context_length": DROP}, "lacks llama.context_length"),
        ({"llama.vocab_size": DROP, "tokenizer.ggml.tokens": DROP}, "lacks llama.vocab_size and tokenizer.ggml.tokens"),
    ],
)  # fmt: skip
def test_a_header_refusal_starts_with_the_file_and_names_the_key(tiny, tmp_path, meta, words):  # noqa: F811
    path = rewrite_gguf(tiny[2], tmp_path / "b.gguf", meta=meta)
    message = refused(path, words)
    assert message.startswith(f"{path}: ") or message.startswith(f"{path} lacks"), message

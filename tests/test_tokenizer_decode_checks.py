"""The tokenizer's decode, as the Python API hands it out (``llm.tokenizer``): a negative or non-integer
id is refused with an error that names it (it was an ``OverflowError`` from the Rust library for -1, and
1.5 was truncated to 1 by the stream decoder); an id past the tokenizer's tokens, as a model's padding
rows give, decodes to nothing, as transformers' tokenizer decodes it. ``encode_prompt``'s system
message must be text (it was a bare "can only concatenate str" TypeError)."""

from __future__ import annotations

import pytest
import torch
from test_tokenizer import gguf_path, hf, meta, tok  # noqa: F401

import kvlens


@pytest.mark.parametrize(
    "ids, error, words",
    [
        ([5, -1], ValueError, r"ids\[1\] = -1 is negative"),
        ([1.5], TypeError, r"ids\[0\] must be an int, got float 1.5"),
        ([True], TypeError, r"ids\[0\] must be an int, got bool"),
        (["a"], TypeError, r"ids\[0\] must be an int, got str"),
        ("abc", TypeError, "ids must be a list of ints, got str"),
        (torch.tensor([1.0]), TypeError, "ids must be an integer tensor, got dtype torch.float32"),
        (torch.tensor([[1, 2]]), ValueError, r"ids must be 1-D, got a tensor of shape \(1, 2\)"),
    ],
)
def test_decode_refuses_ids_no_token_can_have(tok, ids, error, words):  # noqa: F811
    with pytest.raises(error, match=words):
        tok.decode(ids)


def test_decode_skips_an_id_past_the_tokens_as_transformers_does(tok, hf):  # noqa: F811
    ids = tok.encode("The capital of France is")
    past = [ids[0], tok.vocab_size, *ids[1:], tok.vocab_size + 1000]
    assert tok.decode(past) == hf.decode(past) == tok.decode(ids)
    assert tok.decode(torch.tensor(ids)) == tok.decode(ids)
    assert tok.decode([]) == ""


def test_skip_special_must_be_a_bool(tok):  # noqa: F811
    with pytest.raises(TypeError, match="skip_special must be True or False, got str .yes."):
        tok.decode([1], skip_special="yes")


@pytest.mark.parametrize(
    "token_id, error, words",
    [
        (1.5, TypeError, "token id must be an integer, got float 1.5"),
        (-1, ValueError, "token id must be ≥ 0, got -1"),
    ],
)
def test_the_stream_decoder_refuses_what_decode_refuses(tok, token_id, error, words):  # noqa: F811
    stream = tok.stream_decoder()
    with pytest.raises(error, match=words):
        stream.push(token_id)


def test_a_system_message_must_be_text(smol_q8):
    with pytest.raises(TypeError, match="system must be a str, got int"):
        smol_q8.encode_prompt("hi", chat=True, system=5)
    assert smol_q8.encode_prompt("hi", chat=True, system="Be brief.") != smol_q8.encode_prompt(
        "hi", chat=True
    )


@pytest.fixture(scope="module")
def smol_q8():
    return kvlens.load("smollm2", kv="q8")

"""A token's own bytes (the chat logprobs' ``bytes`` field): the default model's whole vocabulary against
GPT-2's byte alphabet as transformers writes it, real text joined back from its tokens' bytes, and
sentencepiece's byte-fallback tokens; None where the decoder does not say."""

from __future__ import annotations

import pytest
from test_tokenizer import gguf_path, meta, tok  # noqa: F401 - fixtures: the SmolLM2 GGUF tokenizer
from test_tokenizer_rules import SPACE, sentencepiece_meta
from tokenizers import Tokenizer as HFBackend
from tokenizers import decoders, models

from kvlens.models.tokenizer import Tokenizer

TEXTS = [
    "Reply with only these emoji: 😀🎉🚀",
    "naïve café, Ærøskøbing; e\u0301 (a combining accent)",
    "東京は日本の首都です。 Привет, мир!",
    "tabs\tand\n\nnewlines  <|im_end|> after a special token",
]


def test_every_byte_level_token_maps_through_gpt2s_alphabet(tok):  # noqa: F811
    convert = pytest.importorskip("transformers.convert_slow_tokenizer")
    to_byte = {c: b for b, c in convert.bytes_to_unicode().items()}
    added = set(tok._tok.get_added_tokens_decoder())
    for i in range(tok.vocab_size):
        piece = tok.id_to_token(i)
        want = piece.encode() if i in added else bytes(to_byte[c] for c in piece)
        assert tok.token_bytes(i) == want, (i, piece)


@pytest.mark.parametrize("text", TEXTS)
def test_a_texts_tokens_join_back_into_its_bytes(tok, text):  # noqa: F811
    ids = tok.encode(text, add_bos=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_sentencepiece_byte_fallback_tokens_are_single_bytes():
    m = sentencepiece_meta()
    m["tokenizer.ggml.tokens"] = [*m["tokenizer.ggml.tokens"], "<0xC3>", "<0xA9>"]
    m["tokenizer.ggml.scores"] = [*m["tokenizer.ggml.scores"], 0.0, 0.0]
    m["tokenizer.ggml.token_type"] = [*m["tokenizer.ggml.token_type"], 6, 6]
    t = Tokenizer.from_gguf_metadata(m)
    ids = t.encode("ab é", add_bos=False)
    assert [t.id_to_token(i) for i in ids] == [f"{SPACE}ab", SPACE, "<0xC3>", "<0xA9>"]
    # the space the file's prefix rule adds is the first token's own: decoding strips it from the text
    assert b"".join(t.token_bytes(i) for i in ids) == " ab é".encode()
    assert t.decode(ids) == "ab é"


def test_a_decoder_that_does_not_say_gives_none():
    backend = HFBackend(models.WordPiece({"[UNK]": 0, "ab": 1, "##c": 2}, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece()
    t = Tokenizer(backend, None, None, set(), False, None)
    assert [t.token_bytes(i) for i in (1, 2)] == [None, None]


def test_an_added_token_is_its_own_text_not_byte_mapped():
    """Added tokens are matched whole in the raw text, so their bytes are their text's, spaces
    included (GPT-2's alphabet has no plain space: mapped, the token would have no bytes)."""
    from test_tokenizer import _tiny_meta

    m = _tiny_meta("gpt2")
    m["tokenizer.ggml.tokens"] = [*m["tokenizer.ggml.tokens"], "<x y>"]
    m["tokenizer.ggml.token_type"] = [*m["tokenizer.ggml.token_type"], 4]  # user-defined
    t = Tokenizer.from_gguf_metadata(m)
    ids = t.encode("a<x y>b", add_bos=False)
    assert len(ids) == 3 and t.token_bytes(ids[1]) == b"<x y>"
    assert b"".join(t.token_bytes(i) for i in ids) == b"a<x y>b"

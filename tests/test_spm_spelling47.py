"""A GGUF sentencepiece vocabulary spells a character it has no token for by byte tokens ``<0xXX>``;
where one is missing, the file's unknown token stands for the character (as in sentencepiece), and a file
that names none would lose it: the `tokenizers` library dropped it without a word (llama.cpp throws).
kvlens refuses such a text with one error, in the Python API and over HTTP. Expected pieces come from
sentencepiece's byte-fallback rule applied by hand to the tiny vocabulary of ``test_tokenizer_rules``."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient
from test_serve_async_engine import new_engine
from test_tokenizer_rules import SPACE, pieces, sentencepiece_meta

import kvlens
from kvlens.models.spm_spelling import UnspellableTextError, spelling_check
from kvlens.models.tokenizer import Tokenizer
from kvlens.serve.app import AppConfig, build_app

TINY_MODEL = ("llama", 5)


def with_tokens(meta: dict, *extra: str, types: int = 1) -> dict:
    """``meta`` with ``extra`` tokens appended (score -9: never a merge's best)."""
    return meta | {
        "tokenizer.ggml.tokens": [*meta["tokenizer.ggml.tokens"], *extra],
        "tokenizer.ggml.scores": [*meta["tokenizer.ggml.scores"], *[-9.0] * len(extra)],
        "tokenizer.ggml.token_type": [*meta["tokenizer.ggml.token_type"], *[types] * len(extra)],
    }


ALL_BYTES = [f"<0x{b:02X}>" for b in range(256)]


def no_unk(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k != "tokenizer.ggml.unknown_token_id"}


@pytest.mark.parametrize(("text", "char"), [("ab c b", "'c' (U+0063)"), ("ab é", "'é' (U+00E9)")])
def test_a_character_without_token_byte_tokens_or_unk_is_refused(text, char):
    tok = Tokenizer.from_gguf_metadata(no_unk(sentencepiece_meta()))
    with pytest.raises(
        UnspellableTextError, match=rf"^the text holds {re.escape(char)}, which the model's vocabulary"
    ):
        tok.encode(text)
    assert pieces(tok, "ab b") == [f"{SPACE}ab", f"{SPACE}b"]  # a text it can spell is tokenized


def test_the_unknown_token_stands_for_a_character_where_the_file_names_one():
    tok = Tokenizer.from_gguf_metadata(sentencepiece_meta())
    assert pieces(tok, "ab c b") == [f"{SPACE}ab", SPACE, "<unk>", f"{SPACE}b"]
    assert pieces(tok, "é") == [SPACE, "<unk>"]


def test_byte_tokens_spell_what_the_vocabulary_lacks():
    tok = Tokenizer.from_gguf_metadata(with_tokens(sentencepiece_meta(), *ALL_BYTES, types=6))
    assert pieces(tok, "ab c b") == [f"{SPACE}ab", SPACE, "<0x63>", f"{SPACE}b"]
    assert pieces(tok, "é") == [SPACE, "<0xC3>", "<0xA9>"]
    assert tok.decode(tok.encode("ab é c", add_bos=False)) == "ab é c"


def test_some_byte_tokens_spell_only_the_characters_all_of_whose_bytes_they_have():
    tok = Tokenizer.from_gguf_metadata(with_tokens(no_unk(sentencepiece_meta()), "<0x63>", "<0xC3>", types=6))
    assert pieces(tok, "c") == [SPACE, "<0x63>"]
    with pytest.raises(UnspellableTextError, match=r"'é' \(U\+00E9\)"):  # 0xA9 is missing
        tok.encode("é")
    with pytest.raises(UnspellableTextError, match=r"'d' \(U\+0064\)"):
        tok.encode("c d")


def test_the_error_counts_the_other_unspellable_characters():
    tok = Tokenizer.from_gguf_metadata(no_unk(sentencepiece_meta()))
    with pytest.raises(UnspellableTextError, match=r"'c' \(U\+0063\).*; 2 more such character\(s\)$"):
        tok.encode("a c d e c")
    with pytest.raises(UnspellableTextError) as one:
        tok.encode("a c")
    assert "more" not in str(one.value)


def test_the_space_prefix_needs_spelling_too():
    """Without "▁" (or its three byte tokens) no text can be tokenized while the file asks for a space
    before it; with ``add_space_prefix`` off, a text without spaces can."""
    meta = no_unk(sentencepiece_meta())
    meta = meta | {
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "<unused>", *meta["tokenizer.ggml.tokens"][4:]]
    }
    with pytest.raises(UnspellableTextError, match=r"holds a space \(sentencepiece's ▁, U\+2581\)"):
        Tokenizer.from_gguf_metadata(meta).encode("ab")
    off = Tokenizer.from_gguf_metadata(meta | {"tokenizer.ggml.add_space_prefix": False})
    assert pieces(off, "ab") == ["ab"]
    with pytest.raises(UnspellableTextError, match="a space"):
        off.encode("ab b")
    assert off.encode("") == [1]  # nothing to spell: the BOS alone


def test_characters_inside_special_tokens_need_no_spelling():
    tok = Tokenizer.from_gguf_metadata(with_tokens(no_unk(sentencepiece_meta()), "<c>", types=3))
    assert pieces(tok, "ab<c>") == [f"{SPACE}ab", "<c>"]
    with pytest.raises(UnspellableTextError, match="'c'"):
        tok.encode("ab<c>c")


def test_a_vocabulary_with_all_byte_tokens_needs_no_check():
    assert spelling_check(ALL_BYTES, True, []) is None
    assert spelling_check(ALL_BYTES[:-1], True, []) is not None


@pytest.fixture(scope="module")
def client(tiny_dir):
    """The real app over the tiny model, whose tokenizer is the byte-less sentencepiece one (its ten ids
    are within the model's vocabulary)."""
    llm = kvlens.load(tiny_dir, kv="q8", attn_backend="numba")
    llm.tokenizer = Tokenizer.from_gguf_metadata(no_unk(sentencepiece_meta()))
    llm.tokenizer.chat_template = "{% for m in messages %}{{ m.content }} {% endfor %}"
    app = build_app(llm, new_engine(llm), AppConfig("tiny"))
    with TestClient(app) as client:
        yield client


ROUTES = [
    ("/v1/completions", "prompt", lambda text: {"prompt": text}),
    ("/v1/chat/completions", "messages", lambda text: {"messages": [{"role": "user", "content": text}]}),
]


@pytest.mark.parametrize(("route", "param", "body"), ROUTES, ids=["completions", "chat"])
def test_the_server_answers_an_unspellable_prompt_with_a_400(client, route, param, body):
    base = {"model": "tiny", "max_tokens": 2, "ignore_eos": True}
    r = client.post(route, json=base | body("ab c"))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith("the text holds 'c' (U+0063)")
    r = client.post(route, json=base | body("ab b"))
    assert r.status_code == 200, r.text  # the server goes on answering

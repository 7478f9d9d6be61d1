"""What a GGUF tokenizer means where its file leaves the special tokens out, as llama.cpp reads it
(``llama_vocab::load`` in src/llama-vocab.cpp): a sentencepiece vocabulary (``tokenizer.ggml.model =
llama``) has BOS 1 and EOS 2 and adds BOS; a byte-level one adds BOS only for the Llama-3 family.
kvlens added no BOS to such a sentencepiece file, so every prompt and perplexity window differed from
llama.cpp's by its first token, without a word (found by the forty-fourth session)."""

from __future__ import annotations

import pytest
from test_tokenizer import _tiny_meta
from test_tokenizer_rules import sentencepiece_meta, write_hf_dir

from kvlens.models.tokenizer import Tokenizer, TokenizerError

UNSAID = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token")


def without(meta: dict, *keys: str) -> dict:
    return {k: v for k, v in meta.items() if k not in keys}


def test_a_sentencepiece_file_that_says_nothing_adds_bos_1_and_stops_at_2():
    tok = Tokenizer.from_gguf_metadata(without(sentencepiece_meta(), *UNSAID))
    assert (tok.bos_id, tok.add_bos, 2 in tok.eos_ids) == (1, True, True)
    assert tok.encode("ab b") == [1, 9, 7]  # <s> ▁ab ▁b


@pytest.mark.parametrize(
    "said, bos_prefix",
    [
        ({"tokenizer.ggml.add_bos_token": False}, []),
        ({"tokenizer.ggml.add_bos_token": True}, [1]),
        ({"tokenizer.ggml.bos_token_id": 3}, [3]),
        ({"tokenizer.ggml.bos_token_id": 3, "tokenizer.ggml.add_bos_token": False}, []),
    ],
)
def test_what_a_sentencepiece_file_says_wins(said, bos_prefix):
    tok = Tokenizer.from_gguf_metadata(without(sentencepiece_meta(), *UNSAID) | said)
    assert tok.bos_prefix == bos_prefix
    assert tok.encode("ab") == [*bos_prefix, 9]


@pytest.mark.parametrize("pre, adds", [(None, False), ("gpt2", False), ("qwen2", False), ("llama-bpe", True)])
def test_a_byte_level_file_adds_bos_by_default_only_in_the_llama3_family(pre, adds):
    tok = Tokenizer.from_gguf_metadata(without(_tiny_meta(pre), "tokenizer.ggml.add_bos_token"))
    assert (tok.bos_id, tok.add_bos) == (0, adds)


@pytest.mark.parametrize("value", ["false", "true", 1, 0])
def test_an_hf_add_bos_token_that_is_not_a_bool_is_refused(tmp_path, value):
    """``bool("false")`` is true: a string there turned BOS on without a word."""
    path = write_hf_dir(tmp_path, {"add_bos_token": value}, {"bos_token_id": 1})
    with pytest.raises(TokenizerError, match=f"add_bos_token must be true or false, got {value!r}"):
        Tokenizer.from_hf_dir(path)


def test_an_hf_add_bos_token_of_null_reads_as_absent(tmp_path):
    """Absent or null: BOS on exactly when tokenizer.json's post-processor adds it (here: none)."""
    tok = Tokenizer.from_hf_dir(write_hf_dir(tmp_path, {"add_bos_token": None, "bos_token": "<s>"}, {}))
    assert (tok.bos_id, tok.add_bos) == (1, False)


@pytest.mark.parametrize("key", ["tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix"])
@pytest.mark.parametrize("value", ["false", 0, 1])
def test_a_gguf_flag_that_is_not_a_bool_is_refused(key, value):
    """llama.cpp's ``get_key`` throws on a key of the wrong type; ``bool("false")`` read as true."""
    with pytest.raises(TokenizerError, match=f"{key} must be a bool, got {type(value).__name__} {value!r}"):
        Tokenizer.from_gguf_metadata(sentencepiece_meta(**{key: value}))

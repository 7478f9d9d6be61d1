"""What a GGUF tokenizer means where its file leaves the special tokens out, as llama.cpp reads it
(``llama_vocab::load`` in src/llama-vocab.cpp): a sentencepiece vocabulary (``tokenizer.ggml.model =
llama``) has BOS 1 and EOS 2 and adds BOS; a byte-level one adds BOS only for the Llama-3 family.
kvlens added no BOS to such a sentencepiece file, so every prompt and perplexity window differed from
llama.cpp's by its first token, without a word (found by the forty-fourth session)."""

from __future__ import annotations

import pytest
from test_tokenizer import _tiny_meta
from test_tokenizer_rules import sentencepiece_meta

from kvlens.models.tokenizer import Tokenizer

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

"""A byte-level GGUF's pre-tokenizer against llama.cpp's (``llm_tokenizer_bpe`` and
``unicode_regex_split``): each family's regexes applied in turn, every one splitting the pieces of the
one before into its matches and the text between them. The reference below is that rule written with
the ``regex`` module, on llama.cpp's expressions copied from its source, so it shares no code with
kvlens (which builds the same splits from the ``tokenizers`` library). Until the forty-fifth session
kvlens ran GPT-2's regex for ``default`` and for a file naming no pre-tokenizer, where llama.cpp runs its
four-step ``default`` chain (punctuation runs first, digits in groups of three)."""

from __future__ import annotations

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tokenizer import _tiny_meta

from kvlens.models.tokenizer import Tokenizer

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA_CPP = {  # llama_vocab pre-type -> regex_exprs, from llama-vocab.cpp
    None: [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],  # DEFAULT (no name given)
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt-2": [GPT2],
    "smollm": [r"\p{N}", GPT2],
    "llama-bpe": [LLAMA3],
    "qwen2": [QWEN2],
}


def llama_cpp_pieces(text: str, exprs: list[str]) -> list[tuple[int, int]]:
    spans = [(0, len(text))]
    for expr in exprs:
        out = []
        for start, end in spans:
            at = start
            for m in regex.finditer(expr, text[start:end]):
                if start + m.start() > at:
                    out.append((at, start + m.start()))
                if m.end() > m.start():
                    out.append((start + m.start(), start + m.end()))
                at = start + m.end()
            if at < end:
                out.append((at, end))
        spans = out
    return spans


def kvlens_pieces(pre: str | None, text: str) -> list[tuple[int, int]]:
    tok = Tokenizer.from_gguf_metadata(_tiny_meta(pre))
    return [span for _, span in tok._tok.pre_tokenizer.pre_tokenize_str(text)]


SAMPLES = [
    "Hello, world! It's 12345 o'clock.",
    "a ,b  c\n\nd  \t e$5+3<=>x^y~z|w",
    "I'M HE'S they'll 2024-12-07 3.14159 ...!!",
    "  leading and trailing  ",
    "x\r\ny\n 42abc1234567 (paren) [br] {c}",
]


@pytest.mark.parametrize("pre", list(LLAMA_CPP))
@pytest.mark.parametrize("text", SAMPLES)
def test_pieces_match_llama_cpps_on_samples(pre, text):
    assert kvlens_pieces(pre, text) == llama_cpp_pieces(text, LLAMA_CPP[pre])


TEXT = st.text(alphabet=st.sampled_from(list("ab Zé9 01\n\t',.!$+<|-_'\"sStTdD")), max_size=40)


@pytest.mark.parametrize("pre", list(LLAMA_CPP))
@settings(max_examples=150, deadline=None)
@given(text=TEXT)
def test_pieces_match_llama_cpps(pre, text):
    assert kvlens_pieces(pre, text) == llama_cpp_pieces(text, LLAMA_CPP[pre])


def test_the_default_chain_differs_from_gpt2_where_llama_cpp_says():
    """Two hand-checked cases: a space before punctuation, and digits in groups of three."""
    text = "a ,b 12345"
    assert [text[a:b] for a, b in kvlens_pieces("gpt-2", text)] == ["a", " ,", "b", " 12345"]
    assert [text[a:b] for a, b in kvlens_pieces("default", text)] == ["a", " ", ",", "b", " ", "123", "45"]

"""Stop strings in the streamed text (serve/output.OutputText), on cases the random texts of
test_serve_units rarely make: a stop that occurs more than once inside one token of a real tokenizer, stops
taken from the text itself (so they complete, often after a held-back prefix of one to five
characters), and special tokens. The forty-second session's mutation run found each unasserted
(docs/testing.md, "Mutation testing of the HTTP service")."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_serve_units import ALPHABET, _reference, tok  # noqa: F401 - tok: the tiny byte-level tokenizer
from test_tokenizer import gguf_path, meta  # noqa: F401 - SmolLM2's tokenizer metadata

from kvlens.models.tokenizer import Tokenizer
from kvlens.serve.output import OutputText


@pytest.fixture(scope="module")
def smol_tok(meta) -> Tokenizer:  # noqa: F811
    return Tokenizer.from_gguf_metadata(meta)


def stream(tokenizer: Tokenizer, ids: list[int], stops: list[str]) -> tuple[str, OutputText]:
    out = OutputText(tokenizer, stops)
    released = []
    for t in ids:
        released.append(out.push(t))
        assert out.text.startswith("".join(released)), "released text was taken back"
    released.append(out.finish())
    return "".join(released), out


@pytest.mark.parametrize("text, stop", [("Wait... no", "."), ("x!! y", "!")])
def test_a_stop_repeated_inside_one_token_cuts_at_its_first_occurrence(smol_tok, text, stop):
    ids = smol_tok.encode(text, add_bos=False)
    assert any(smol_tok.decode([i]).count(stop) >= 2 for i in ids)  # the premise: one token, two stops
    got, out = stream(smol_tok, ids, [stop])
    assert got == text[: text.index(stop)] == _reference(smol_tok, ids, [stop])[0] and out.stopped


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=ALPHABET, min_size=2, max_size=24), data=st.data())
def test_a_stop_taken_from_the_text_cuts_it_as_a_full_decode_would(tok, text, data):  # noqa: F811
    """Each stop is a piece of the text (it completes), or a piece with one more character (only its
    prefix may occur: held back, then released); the released text is the reference's either way."""
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(text) - 1))
        j = data.draw(st.integers(i + 1, min(len(text), i + 5)))
        tail = data.draw(st.sampled_from(["", *ALPHABET]))
        stops.append(text[i:j] + tail)
    ids = tok.encode(text)
    got, out = stream(tok, ids, stops)
    want, want_stopped = _reference(tok, ids, stops)
    assert got == want and out.stopped == want_stopped


def test_a_stop_whose_prefix_ends_the_text_so_far_is_held_back_until_it_completes(tok):  # noqa: F811
    """ "abc" arrives a character at a time: "a" and "ab" may still begin the stop, so nothing after
    "x" is released before the stop completes, and then nothing more is."""
    ids = tok.encode("xabcd")
    assert len(ids) == 5  # the premise: one token per character
    out = OutputText(tok, ["abc"])
    assert [out.push(t) for t in ids] == ["x", "", "", "", ""] and out.finish() == ""
    assert out.text == "x" and out.stopped


def test_special_tokens_add_no_text(tok):  # noqa: F811
    """A special token the model emits (an end-of-turn it was not told to stop at) is not text."""
    specials = [tok.encode(s) for s in ("<|im_end|>", "<|im_start|>")]
    assert all(len(ids) == 1 for ids in specials)  # the premise: each is one (special) token
    ids = [*tok.encode("a"), *specials[0], *specials[1], *tok.encode("b")]
    got, out = stream(tok, ids, [])
    assert got == "ab" == tok.decode(ids, skip_special=True) and not out.stopped

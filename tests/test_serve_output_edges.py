"""Stop strings that complete in the same token (the planted-bug campaign of the thirty-third session
found this untested: the property test's random stops rarely overlap so)."""

from __future__ import annotations

from test_serve_units import _reference, tok  # noqa: F401 - tok is the module's tokenizer fixture

from kvlens.serve.output import OutputText, TokenLogprob, chat_logprobs


def test_the_earliest_of_two_stops_completing_together_wins(tok) -> None:  # noqa: F811
    """Stops "b" and "ab" on "xab": both complete with the "b"; the text ends before "ab"."""
    ids = tok.encode("xab c")
    stops = ["b", "ab"]
    out = OutputText(tok, stops)
    released = [out.push(t) for t in ids]
    released.append(out.finish())
    assert "".join(released) == "x" == _reference(tok, ids, stops)[0] and out.stopped


def test_chat_logprobs_bytes_are_the_whole_utf8_of_each_token(tok) -> None:  # noqa: F811
    """OpenAI's ``bytes``: the token's UTF-8 bytes, all of them, for the token and every alternative."""
    (a,) = tok.encode("a")
    item = TokenLogprob(a, "é€", -0.25, [(a, -0.25)], 0)
    (entry,) = chat_logprobs(tok, [item])["content"]
    assert entry["token"] == "é€" and entry["bytes"] == [0xC3, 0xA9, 0xE2, 0x82, 0xAC]
    assert entry["top_logprobs"] == [{"token": "a", "logprob": -0.25, "bytes": [0x61]}]

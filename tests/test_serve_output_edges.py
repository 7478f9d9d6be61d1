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


def test_chat_logprobs_bytes_are_each_tokens_own_bytes(tok) -> None:  # noqa: F811
    """OpenAI's ``bytes``: each token's own bytes, for the token and every alternative, so that joining
    them gives the reply's UTF-8 even where a character spans tokens (whose text alone is U+FFFD)."""
    text = "xé€😀 a"
    ids = tok.encode(text, add_bos=False)
    items = [TokenLogprob(i, tok.decode([i]), -0.25, [(i, -0.5)], 0) for i in ids]
    content = chat_logprobs(tok, items)["content"]
    assert any(e["token"] == "\ufffd" for e in content)  # the premise: a character split over tokens
    assert b"".join(bytes(e["bytes"]) for e in content) == text.encode("utf-8")
    assert [e["top_logprobs"][0]["bytes"] for e in content] == [e["bytes"] for e in content]

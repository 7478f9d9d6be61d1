"""Server pieces without a server: streamed text with stop strings, request validation, sizes."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import write_tokenizer_json

from kvlens import cli
from kvlens.models.tokenizer import Tokenizer
from kvlens.serve.cli import parse_size
from kvlens.serve.output import OutputText
from kvlens.serve.protocol import ChatRequest, CompletionRequest


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    """A byte-level BPE tokenizer: multi-byte characters span several tokens."""
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_json(d)
    return Tokenizer.from_hf_dir(d)


def _reference(tok: Tokenizer, ids: list[int], stops: list[str]) -> tuple[str, bool]:
    """Decode growing prefixes; the first one whose text holds a stop string ends the output there
    (the stop string's earliest start in that text), as OpenAI-style servers check after each token."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special=True).rstrip("\ufffd")
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return tok.decode(ids, skip_special=True), False


ALPHABET = "ab th\né€😀"


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, min_size=1, max_size=24),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3),
    extra=st.integers(0, 3),
)
def test_streamed_text_is_the_decode_cut_at_the_first_stop(tok, text, stops, extra):
    ids = tok.encode(text)
    want, want_stopped = _reference(tok, ids, stops)
    out = OutputText(tok, stops)
    released = []
    for t in ids:
        released.append(out.push(t))
        if out.stopped and extra == 0:
            break
        if out.stopped:  # a few more tokens may arrive before the abort lands: they change nothing
            extra -= 1
        assert out.text.startswith("".join(released)), "released text was taken back"
    released.append(out.finish())
    assert "".join(released) == want
    assert out.stopped == want_stopped


def test_stop_token_counts_but_adds_no_text_or_logprob(tok):
    out = OutputText(tok, [])
    ids = tok.encode("the a")
    for t in ids:
        out.push(t, logprob=-0.5, top=[])
    eos = tok.eos_ids and next(iter(tok.eos_ids))
    assert out.push(eos, logprob=-0.1, top=[], is_stop_token=True) == ""
    assert out.text + out.finish() == "the a"
    assert out.token_ids == [*ids, eos] and len(out.logprobs) == len(ids)
    # a stop id that is an ordinary token (a GGUF whose EOS is not marked special): still no text
    plain = OutputText(tok, [])
    (b,) = tok.encode("b")
    assert plain.push(b, is_stop_token=True) == "" and plain.text + plain.finish() == ""


def test_text_offset_is_where_each_tokens_text_starts_even_while_text_is_held_back(tok):
    """A tail that could still begin a stop string is held back from the client, not from the text:
    each token's offset is the length of the decode of the tokens before it."""
    ids = tok.encode("the az b thaz ab")
    out = OutputText(tok, ["zq", "a z"])  # "a", "z" and "a " begin stop strings that never complete
    for t in ids:
        out.push(t, logprob=-1.0, top=[])
    assert not out.stopped and out.text + out.finish() == "the az b thaz ab"
    assert [e.text_offset for e in out.logprobs] == [len(tok.decode(ids[:i])) for i in range(len(ids))]


@pytest.mark.parametrize(
    "text,size",
    [("512MiB", 512 << 20), ("1.5GiB", 3 << 29), ("64KiB", 64 << 10), ("4096", 4096), (" 2 gib ", 2 << 30)],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "MiB", "12XB", "-1MiB", "0MiB", "1e9", "5 MB"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="bad size"):
        parse_size(text)


@pytest.mark.parametrize(
    "args,line",
    [
        # (a bad --kv-budget / --kv-disk-budget is a usage error at parse time: test_bad_input_options36)
        (
            ["--kv-disk", "d", "--no-prefix-cache"],
            "error: --kv-disk holds prefix-cache blocks: drop --no-prefix-cache",
        ),
    ],
)
def test_serve_bad_option_is_one_error_line(monkeypatch, capsys, args, line):
    """The real entry point in this process (a subprocess per case cost ~10 s of imports): exit 2 and
    one error line, before any model loads (the process boundary: test_bad_input_cli's process tests)."""

    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before serve's options were checked")

    monkeypatch.setattr("kvlens.load", load)
    monkeypatch.setattr(sys, "argv", ["kvlens", "serve", *args])
    with pytest.raises(SystemExit) as e:
        cli.main()
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.strip().splitlines() == [line]


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"model": "m", "prompt": "x", "n": 3}, "n=1"),
        ({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "m", "prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"model": "m", "prompt": "x", "frequency_penalty": -0.5}, "frequency_penalty"),
        ({"model": "m", "prompt": "x", "logit_bias": {"1": 2.0}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "echo": True}, "echo"),
        ({"model": "m", "prompt": "x", "best_of": 2}, "best_of=1"),
        ({"model": "m", "prompt": "x", "suffix": "end"}, "suffix"),
        ({"model": "m", "prompt": "x", "n": 2, "suffix": "end"}, "n=1"),  # the shared rules come first
        ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream"),
        ({"model": "m", "prompt": "x", "tools": []}, "tools"),
        ({"model": "m", "prompt": "x", "temperature": 2.5}, "temperature"),
    ],
)
def test_completion_request_refuses_what_it_cannot_honour(body, needle):
    with pytest.raises(ValueError, match=needle):
        CompletionRequest.model_validate(body)


def test_chat_request_refuses_top_logprobs_without_logprobs():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    with pytest.raises(ValueError, match="top_logprobs requires logprobs"):
        ChatRequest.model_validate(chat)
    with pytest.raises(ValueError, match="only n=1"):  # the shared rules apply to chat too
        ChatRequest.model_validate(chat | {"n": 2})


def test_chat_content_parts_are_joined():
    msg = {
        "role": "user",
        "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}],
    }
    chat = ChatRequest.model_validate({"model": "m", "messages": [msg]})
    # by a newline, as vLLM and llama.cpp's server join them (test_chat_message47)
    assert chat.messages[0].for_template() == {"role": "user", "content": "Hello, \nworld"}
    with pytest.raises(ValueError):  # image parts: not a text model
        ChatRequest.model_validate(
            {
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            }
        )


def test_requests_accept_openai_defaults():
    c = CompletionRequest.model_validate({"model": "m", "prompt": "x", "stop": "END", "user": "u", "n": 1})
    assert (c.max_tokens, c.temperature, c.stop_strings) == (16, 1.0, ["END"])
    chat = ChatRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5,
         "logprobs": True, "top_logprobs": 2}
    )  # fmt: skip
    assert (chat.token_limit, chat.logprobs_top) == (5, 2)
    assert (
        ChatRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        ).logprobs_top
        is None
    )


@pytest.mark.parametrize(
    ("model", "body", "param", "needle"),
    [
        # a list of chat content parts fails the str branch on its type: the list branch's error speaks
        (ChatRequest, {"content": [{"type": "text", "text": "a\udfff"}]}, "messages.0.content.0.text",
         "text is not valid UTF-8 text (bad character at index 1)"),
        (ChatRequest, {"content": [{"type": "image_url", "image_url": {}}]}, "messages.0.content.0.type",
         "Input should be 'text'"),
        (ChatRequest, {"content": 5}, "messages.0.content", "Input should be a valid string"),  # neither
        (CompletionRequest, {"prompt": "hi \ud800"}, "prompt", "prompt is not valid UTF-8 text"),
        # a list of strings or of lists is OpenAI's batch form: refused as such, not as a bad token id
        (CompletionRequest, {"prompt": ["a"]}, "prompt", "a list of prompts (a batch) is not supported"),
        (CompletionRequest, {"prompt": [[1, 2]]}, "prompt", "a list of prompts (a batch) is not supported"),
        # token ids are JSON integers: not true, "12" or 12.0 (lax mode would read them as 1, 12, 12)
        (CompletionRequest, {"prompt": [1, True]}, "prompt.1", "Input should be a valid integer"),
        (CompletionRequest, {"prompt": [3, "12"]}, "prompt.1", "Input should be a valid integer"),
        (CompletionRequest, {"prompt": [12.0]}, "prompt.0", "Input should be a valid integer"),
        # every branch fails on a type: the one that read deepest names the field (not "a valid string")
        (ChatRequest, {"content": [{"type": "text", "text": None}]}, "messages.0.content.0.text",
         "Input should be a valid string"),
        (CompletionRequest, {"prompt": "x", "max_tokens": True}, "max_tokens", "not a boolean"),
    ],
)  # fmt: skip
def test_a_union_error_names_the_branch_the_input_took(model, body, param, needle):
    """The HTTP error of an invalid body (FastAPI's ``loc`` starts with "body"): the field path alone
    as ``param``, and the message of the union branch the input's type matched."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from kvlens.serve.app import _validation_message

    if model is ChatRequest:
        body = {"model": "m", "messages": [{"role": "user"} | body]}
    else:
        body = {"model": "m"} | body
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    errors = [e | {"loc": ("body", *e["loc"])} for e in info.value.errors()]
    message, got = _validation_message(RequestValidationError(errors))
    assert got == param and needle in message and message.startswith(f"{param}: ")

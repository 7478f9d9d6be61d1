"""A chat message's content parts and name, as the chat template receives them. vLLM (for a template
that reads content as text: ``"\\n".join(texts)`` in ``_parse_chat_message_content_parts``) and
llama.cpp's server (``concat_typed_text``: a newline between parts) join text parts with newlines, and
vLLM and transformers hand the template a message's ``name``. kvlens joined parts with nothing between
them and dropped the name, so the same request gave another prompt than on those servers."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from test_serve_async_engine import new_engine

import kvlens
from kvlens.serve.app import AppConfig, build_app
from kvlens.serve.protocol import ChatRequest

TINY_MODEL = ("llama", 5)
# The prompt as the template writes it, one message a line: role, name (or "-"), content between bars.
TEMPLATE = "{% for m in messages %}{{ m.role }} {{ m.name | default('-') }} |{{ m.content }}|\n{% endfor %}"


def parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


@pytest.mark.parametrize(
    ("content", "want"),
    [
        (parts("a", "b"), "a\nb"),
        (parts("Hello,", " world", "!"), "Hello,\n world\n!"),
        (parts("one"), "one"),
        (parts("a", "", "b"), "a\n\nb"),
        ("plain text", "plain text"),
    ],
)
def test_content_parts_are_joined_by_newlines(content, want):
    chat = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": content}]})
    assert chat.messages[0].for_template() == {"role": "user", "content": want}


def test_a_name_reaches_the_template_only_where_given():
    msgs = [{"role": "user", "content": "hi", "name": "ann"}, {"role": "user", "content": "yo"}]
    chat = ChatRequest.model_validate({"model": "m", "messages": msgs})
    assert [m.for_template() for m in chat.messages] == [
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "user", "content": "yo"},
    ]
    assert ChatRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x", "name": ""}]}
    ).messages[0].for_template() == {"role": "user", "content": "x", "name": ""}


@pytest.fixture(scope="module")
def served(tiny_dir):
    """The real app over the tiny model, with a template that shows what it was given; the prompt each
    request tokenized is kept."""
    llm = kvlens.load(tiny_dir, kv="q8", attn_backend="numba")
    llm.tokenizer.chat_template = TEMPLATE
    seen: list[str] = []
    render = llm.tokenizer.apply_chat_template

    def recording(messages, *args, **kwargs):
        seen.append(render(messages, *args, **kwargs))
        return seen[-1]

    llm.tokenizer.apply_chat_template = recording
    with TestClient(build_app(llm, new_engine(llm), AppConfig("tiny"))) as client:
        yield client, seen


def test_the_server_renders_parts_and_name_as_the_reference_servers_do(served):
    client, seen = served
    messages = [
        {"role": "system", "content": "be brief", "name": "rules"},
        {"role": "user", "content": parts("first line", "second line")},
    ]
    r = client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 1, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    assert seen[-1] == "system rules |be brief|\nuser - |first line\nsecond line|\n"


def test_a_name_that_is_not_valid_unicode_is_a_400_naming_it(served):
    client, _ = served
    body = '{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "x", "name": "a\\udfff"}]}'
    r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages.0.name"

"""OpenAI wire format: request models (validated, unknown fields refused) and response builders.

Field names, defaults and limits follow OpenAI's completions and chat-completions APIs. Fields
kvlens cannot honour are accepted only at their neutral value (``n=1``, penalties 0, no
``logit_bias``, ``echo`` false), so a client never silently gets something it did not ask for;
fields OpenAI does not know are refused, as OpenAI's API does ("Unrecognized request argument"),
except vLLM's ``ignore_eos`` (load generators use it to get exact output lengths).
"""

from __future__ import annotations

import math
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..checks import check_text

# OpenAI's own bounds (completions: logprobs ≤ 5; chat: top_logprobs ≤ 20; up to 4 stop sequences).
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
MAX_STOP_SEQUENCES = 4


def _unicode(text: str, info: ValidationInfo) -> str:
    return check_text(text, info.field_name or "text")  # JSON's "\ud800" escape decodes to a lone surrogate


Text = Annotated[str, AfterValidator(_unicode)]  # a str the tokenizer can encode (valid Unicode)


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):  # pydantic's lax mode would read true as 1
        raise ValueError("Input should be a number, not a boolean")
    return value


Int = Annotated[int, BeforeValidator(_not_bool)]


def _finite_number(value: Any) -> Any:
    value = _not_bool(value)
    try:
        number = float(value)  # what pydantic's lax mode would read (a JSON NaN, or the string "nan")
    except (TypeError, ValueError, OverflowError):
        return value  # not a number at all, or an int past float's range: pydantic's own message says so
    if not math.isfinite(number):  # else NaN would fail the field's ge / le, with a misleading message
        raise ValueError("Input should be a finite number")
    return value


Float = Annotated[float, BeforeValidator(_finite_number)]


def _one_prompt(value: Any) -> Any:
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        raise ValueError("a list of prompts (a batch) is not supported: send one prompt per request")
    return value


# A token id is a JSON integer: pydantic's lax mode would also take true, "12" and 12.0
TokenIds = list[Annotated[int, Strict()]]


class APIError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {"message", "type", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(
    message: str, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    # a lone surrogate the client sent, echoed in a message, would make the body unencodable (a 500)
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _Common(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid")

    model: Text
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: Float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Float = Field(default=1.0, gt=0.0, le=1.0)
    seed: Int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    n: Int = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own logs; no effect on the output
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: StrictBool = False  # vLLM's extension (benchmarks): run to max_tokens whatever comes

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("a stop sequence must not be empty")
        for s in stops:
            check_text(s, "a stop sequence")
        return stops

    def _refusals(self) -> list[tuple[bool, str]]:
        """(refused, message) for each request form kvlens refuses, in the order they are checked;
        an endpoint's model appends its own to these."""
        return [
            (self.n != 1, "only n=1 is supported"),
            (
                bool(self.presence_penalty or self.frequency_penalty),
                "presence_penalty and frequency_penalty are not supported (use 0)",
            ),
            (bool(self.logit_bias), "logit_bias is not supported"),
            (
                self.stream_options is not None and not self.stream,
                "stream_options is only allowed when stream is true",
            ),
        ]

    @model_validator(mode="after")
    def _refuse(self) -> _Common:
        for refused, message in self._refusals():
            if refused:
                raise ValueError(message)
        return self

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])  # a list once validated; None when left out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: Annotated[Text | TokenIds, BeforeValidator(_one_prompt)]
    max_tokens: Int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: StrictBool = False
    best_of: Int | None = None
    suffix: str | None = None

    def _refusals(self) -> list[tuple[bool, str]]:
        return super()._refusals() + [
            (self.echo, "echo is not supported"),
            (self.best_of not in (None, 1), "only best_of=1 is supported"),
            (bool(self.suffix), "suffix is not supported"),
        ]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]  # text, or OpenAI's list of content parts (text parts only)
    name: Text | None = None  # a participant's name, which some templates write

    def for_template(self) -> dict[str, str]:
        """The message as a chat template reads it: content parts joined by newlines, as vLLM joins them
        for a template that reads content as text (llama.cpp's server too, but after leading empty
        parts); ``name`` where given, as vLLM and transformers pass it."""
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": self.role, "content": text} | ({"name": self.name} if self.name is not None else {})


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)

    def _refusals(self) -> list[tuple[bool, str]]:
        return super()._refusals() + [
            (
                self.top_logprobs is not None and not self.logprobs,
                "top_logprobs requires logprobs to be true",
            ),
        ]

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprobs_top(self) -> int | None:
        """The engine's ``logprobs``: None for none, else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def envelope(kind: str, rid: str, model: str, created: int) -> dict[str, Any]:
    """The fields every response object starts with; ``created`` is passed, not filled in, so every
    chunk of one stream carries the one timestamp its caller took."""
    return {"id": rid, "object": kind, "created": created, "model": model}

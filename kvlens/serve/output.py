"""A request's output as it grows: incremental text with stop strings, token log-probabilities.

Text is released to the client only once it is final: the tokenizer's stream decoder holds back
split UTF-8 characters, and this class holds back any tail that could still become a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..models.tokenizer import Tokenizer


@dataclass
class TokenLogprob:
    token_id: int
    text: str
    logprob: float
    top: list[tuple[int, float]]
    text_offset: int  # where the token's text starts in the output


@dataclass
class OutputText:
    """Detokenizes a request's tokens and cuts the text at the earliest stop string."""

    tokenizer: Tokenizer
    stops: list[str]
    text: str = ""  # decoded so far (cut before a stop string once one is seen)
    stopped: bool = False  # a stop string was found: the request must end
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    _sent: int = 0  # characters of ``text`` already released

    def __post_init__(self) -> None:
        self._decoder = self.tokenizer.stream_decoder(skip_special=True)

    def push(
        self,
        token_id: int,
        logprob: float | None = None,
        top: list[tuple[int, float]] | None = None,
        is_stop_token: bool = False,
    ) -> str:
        """Add a generated token; returns the text that became final (may be empty).

        A stop token counts as output (usage) but adds no text and no logprobs entry, as in OpenAI's API.
        """
        self.token_ids.append(token_id)
        if logprob is not None and not is_stop_token:
            self.logprobs.append(
                TokenLogprob(token_id, self._piece(token_id), logprob, list(top or []), len(self.text))
            )
        if self.stopped or is_stop_token:
            return ""
        self._extend(self._decoder.push(token_id))
        return self._release(final=False)

    def finish(self) -> str:
        """The request ended: release everything left (the decoder's held-back bytes included)."""
        if not self.stopped:
            self._extend(self._decoder.flush())
        return self._release(final=True)

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _extend(self, piece: str) -> None:
        if not piece:
            return
        start = max(0, len(self.text) - max((len(s) for s in self.stops), default=0) + 1)
        self.text += piece
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        end = max(end, self._sent)
        out, self._sent = self.text[self._sent : end], end
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        for n in range(min(len(self.text), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0


def completion_logprobs(tok: Tokenizer, items: list[TokenLogprob]) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object."""
    return {
        "tokens": [t.text for t in items],
        "token_logprobs": [t.logprob for t in items],
        "top_logprobs": [{tok.decode([i]): lp for i, lp in t.top} for t in items],
        "text_offset": [t.text_offset for t in items],
    }


def _chat_entry(tok: Tokenizer, token_id: int, text: str, logprob: float) -> dict[str, Any]:
    """OpenAI's entry: ``bytes`` are the token's own bytes (part of a UTF-8 character for some
    tokens, whose text alone is U+FFFD), so a client can join them back into the reply; null where
    the tokenizer's decoder does not say."""
    raw = tok.token_bytes(token_id)
    return {"token": text, "logprob": logprob, "bytes": None if raw is None else list(raw)}


def chat_logprobs(tok: Tokenizer, items: list[TokenLogprob]) -> dict[str, Any]:
    """The chat-completions ``logprobs`` object (``content``: one entry per token)."""
    return {
        "content": [
            {
                **_chat_entry(tok, t.token_id, t.text, t.logprob),
                "top_logprobs": [_chat_entry(tok, i, tok.decode([i]), lp) for i, lp in t.top],
            }
            for t in items
        ]
    }

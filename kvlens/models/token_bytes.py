"""The raw bytes a token stands for, read from the vocabulary and the tokenizer's decoder: what
OpenAI's logprobs ``bytes`` field carries, so that a client can join a reply's tokens back into its
UTF-8 text even where a character is split over tokens (decoding such a token alone gives U+FFFD).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import lru_cache

from tokenizers import Tokenizer as _HFTokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte-fallback tokens


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the
    other 68 for the characters 256, 257, … in byte order (GPT-2's ``bytes_to_unicode``, inverted)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    table = {chr(b): b for b in kept}
    table.update({chr(256 + i): b for i, b in enumerate(moved)})
    return table


def _decoder_steps(backend: _HFTokenizer) -> list[dict]:
    if backend.decoder is None:
        return []
    state = json.loads(backend.decoder.__getstate__())
    return state.get("decoders", [state]) if state.get("type") == "Sequence" else [state]


def token_bytes_reader(backend: _HFTokenizer) -> Callable[[int], bytes | None]:
    """A function from a token id to its bytes, or to None where this decoder's bytes per token are
    not known (a decoder other than byte-level BPE's or sentencepiece's byte fallback)."""
    steps = _decoder_steps(backend)
    kinds = {s.get("type") for s in steps}
    added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
    replaces = [
        (s["pattern"]["String"], s["content"])
        for s in steps
        if s.get("type") == "Replace" and "String" in s.get("pattern", {})
    ]

    def read(token_id: int) -> bytes | None:
        if token_id in added:  # matched whole in the text, never byte-mapped
            return added[token_id].encode("utf-8")
        piece = backend.id_to_token(token_id)
        if piece is None:
            return None
        if "ByteLevel" in kinds:
            table = _byte_level_table()
            return bytes(table[c] for c in piece) if all(c in table for c in piece) else None
        if "ByteFallback" in kinds:
            byte = _BYTE_TOKEN.fullmatch(piece)
            if byte:
                return bytes([int(byte.group(1), 16)])
            for pattern, content in replaces:
                piece = piece.replace(pattern, content)
            return piece.encode("utf-8")
        return None

    return read

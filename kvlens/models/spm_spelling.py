"""Characters a GGUF sentencepiece vocabulary cannot spell, where it names no unknown token: refused.

A sentencepiece vocabulary spells a character that has no token of its own by its UTF-8 bytes, each as a
byte token ``<0xXX>``. Where one is missing, the `tokenizers` library (as sentencepiece itself) gives the
file's unknown token, and without one drops the character without a word: the text then scored or
answered is not the text given. llama.cpp throws there (``llm_tokenizer_spm_session::resegment`` →
``byte_to_token``'s ``token_to_id.at``). Every real sentencepiece GGUF holds all 256 byte tokens, so the
check exists only for one that does not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

SPACE = "\u2581"  # sentencepiece's visible space, which a text's spaces become before lookup


class UnspellableTextError(ValueError):
    """A text holds a character the model's vocabulary has no token for, not even as bytes."""


def spelling_check(
    tokens: Iterable[str], space_prefix: bool, specials: Iterable[str]
) -> Callable[[str], None] | None:
    """A check that raises :class:`UnspellableTextError` for a text holding a character ``tokens`` can
    spell neither whole nor as byte tokens; None where the vocabulary has all 256 byte tokens (every
    character is spellable). ``space_prefix``: the tokenizer puts a space before the text (which needs
    spelling too); ``specials``: tokens matched whole in the text, whose characters need no spelling."""
    vocab = set(tokens)
    have_byte = [f"<0x{b:02X}>" in vocab for b in range(256)]
    if all(have_byte):
        return None
    specials = sorted((s for s in specials if s), key=len, reverse=True)

    def unspellable(text: str) -> list[str]:
        chars = set(text.replace(" ", SPACE)) | ({SPACE} if space_prefix and text else set())
        return sorted(c for c in chars if c not in vocab and not all(have_byte[b] for b in c.encode()))

    def check(text: str) -> None:
        missing = unspellable(text)
        if missing:  # rare: look again with the special tokens' own text taken out
            for special in specials:
                text = text.replace(special, "")
            missing = unspellable(text)
        if missing:
            c = missing[0]
            shown = "a space (sentencepiece's \u2581, U+2581)" if c == SPACE else f"{c!r} (U+{ord(c):04X})"
            more = f"; {len(missing) - 1} more such character(s)" if len(missing) > 1 else ""
            raise UnspellableTextError(
                f"the text holds {shown}, which the model's vocabulary cannot spell (no token for it, no byte "
                f"tokens <0x..> for its UTF-8 bytes, no unknown token): it would be dropped{more}"
            )

    return check

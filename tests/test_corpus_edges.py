"""Gutenberg stripping where a header holds two start markers (found untested by the planted-bug
campaign of the thirty-third session)."""

from __future__ import annotations

import pytest
from test_corpus import BODY

from kvlens.corpus import CorpusError, load_corpus, strip_gutenberg


def test_the_header_ends_at_the_last_start_marker() -> None:
    """A 1990s small-print header followed by a modern start line: the text starts after the second."""
    text = (
        "**The Project Gutenberg Etext of Hamlet**\n"
        "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n"
        "Produced by volunteers.\n"
        "*** START OF THE PROJECT GUTENBERG EBOOK HAMLET ***\n\n"
        + BODY
        + "\n*** END OF THE PROJECT GUTENBERG EBOOK HAMLET ***\n"
    )
    assert strip_gutenberg(text) == BODY


def test_a_directory_is_not_a_corpus(tmp_path) -> None:
    with pytest.raises(CorpusError, match="is not a regular file"):
        load_corpus(tmp_path)

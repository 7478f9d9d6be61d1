"""A corpus cache that is not a directory is named (thirty-sixth session's sweep: `KVLENS_CACHE=/dev/null
kvlens corpus list` said only "[Errno 17] File exists: '/dev/null'")."""

from __future__ import annotations

import pytest

from kvlens.corpus import CorpusError, fetch_shakespeare


def test_a_cache_that_is_a_file_is_named(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    path.write_text("not a folder")
    monkeypatch.setenv("KVLENS_CACHE", str(path))
    with pytest.raises(CorpusError, match=f"the corpus cache {path} \\(KVLENS_CACHE\\) is not a directory"):
        fetch_shakespeare()
    with pytest.raises(CorpusError, match=f"the corpus cache {path} is not a directory"):
        fetch_shakespeare(path)

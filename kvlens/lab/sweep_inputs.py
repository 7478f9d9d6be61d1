"""What a sweep cell measured: the sha256 of its model's files and of the text it read, and the check
that a resumed sweep still measures the same files.

A cell's key is its configuration (model and corpus by name or path, :mod:`.sweep_spec`), not the
files' contents, so a GGUF or a text replaced at the same path keeps its cells' keys. Each done cell
therefore records the digests of what it measured (``result[store.INPUTS]``). The driver takes the
spec's digests before the first cell (:func:`spec_digests`), refuses a store whose done cells measured
other files under the same names (:func:`check_unchanged`), and stores a cell that measured another file
as failed (:func:`check_outcome`): results of two files never stand in one store under one name.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from ..corpus import load_corpus
from ..models.loader import file_digest, resolve_model
from .store import INPUTS, CellOutcome
from .sweep_spec import Cell


class InputChangedError(ValueError):
    """A model or corpus file differs from the one the store's done cells measured."""


def model_digest(model: str) -> str:
    """sha256 of the model file (an HF directory: of its files' names and digests)."""
    return file_digest(resolve_model(model))


def text_digest(text: str) -> str:
    """sha256 of the text a cell measured, as UTF-8 (a user's file: its bytes less one final newline,
    as :func:`kvlens.corpus.read_like_llama_cpp` reads it)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def inputs_of(model_sha256: str, text: str) -> dict[str, str]:
    return {"model_sha256": model_sha256, "corpus_sha256": text_digest(text)}


def _or_none(digest: Callable[[], str]) -> str | None:
    try:
        return digest()
    except (ValueError, OSError):  # not a model or text kvlens reads: its cells fail, each with the error
        return None


def spec_digests(cells: Sequence[Cell]) -> dict[tuple[str, str], str | None]:
    """The driver's digests of the spec's models and corpora, ``{(kind, name): sha256}``, taken once
    before any cell runs: the files the whole sweep is to measure (None: unreadable then)."""
    models = {("model", m): _or_none(lambda m=m: model_digest(m)) for m in sorted({c.model for c in cells})}
    corpora = sorted({c.corpus for c in cells})
    return models | {("corpus", c): _or_none(lambda c=c: text_digest(load_corpus(c)[0])) for c in corpora}


def check_unchanged(
    stored: Iterable[tuple[str, str, str, str | None]],
    cells: Sequence[Cell],
    digests: dict[tuple[str, str], str | None],
    force: bool,
    db: Path,
) -> None:
    """Refuse to run ``cells`` into a store whose done cells measured other files under the same model
    or corpus name. ``stored``: (cell key, model, corpus, inputs JSON or None: recorded before kvlens
    kept digests, not checked) of the store's done cells; ``digests``: :func:`spec_digests`;
    ``force``: the spec's own cells are redone."""
    redone = {c.key for c in cells} if force else set()
    seen: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for key, model, corpus, inputs in stored:
        if key in redone or not inputs:
            continue
        recorded = json.loads(inputs)
        for kind, name in (("model", model), ("corpus", corpus)):
            if (kind, name) in digests:
                seen[kind, name][recorded[f"{kind}_sha256"]] += 1
    for (kind, name), counts in sorted(seen.items()):
        now = digests[kind, name]
        stale = {d: n for d, n in counts.items() if d != now} if now else {}  # unreadable: cells fail
        if stale:
            then = next(iter(stale))
            said = (
                f"{kind} {name} has changed since {sum(stale.values())} done cell(s) in {db} measured it "
                f"(sha256 {then[:12]}… then, {now[:12]}… now)"
            )
            if force:
                raise InputChangedError(f"{said}; --force redoes this spec's cells only, and those cells are "
                                        "outside it: give another store (--db)")  # fmt: skip
            raise InputChangedError(f"{said}: their results and the new file's would stand under one name; "
                                    "rerun with --force to replace them, or give another store (--db)")  # fmt: skip


def check_outcome(outcome: CellOutcome, digests: dict[tuple[str, str], str | None]) -> CellOutcome:
    """A done cell that measured other files than the driver's (a file replaced during the sweep, or
    a cluster node holding another file at the same path) is stored as failed, with both digests."""
    if outcome.status != "done":
        return outcome
    config, recorded = json.loads(outcome.config_json), outcome.result[INPUTS]
    for kind in ("model", "corpus"):
        expected, got = digests[kind, config[kind]], recorded[f"{kind}_sha256"]
        if got != expected:
            then = f"{expected[:12]}… at the start" if expected else "unreadable at the start"
            outcome.status, outcome.result, outcome.metrics = "failed", None, {}
            outcome.error = (
                f"InputChangedError: the {kind} file {config[kind]} that {outcome.worker} measured is not "
                f"the one this sweep began with (sha256 {got[:12]}… there, {then})"
            )
            break
    return outcome

"""A bounded drive loop for the serving engine's tests: a scheduler bug that never finishes a request
fails the test after ``limit`` steps instead of hanging the suite."""

from __future__ import annotations

from collections.abc import Iterator, Sized


def steps_until_done(engine, limit: int = 5000, pending: Sized = ()) -> Iterator[None]:
    """Yield once per step while ``engine`` has unfinished requests or ``pending`` (the caller's requests
    still to add) is not empty; AssertionError after ``limit``."""
    for _ in range(limit):
        if not (pending or engine.has_unfinished()):
            return
        yield
    raise AssertionError(f"requests still unfinished after {limit} engine steps")

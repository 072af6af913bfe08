"""Bugs the campaign finds in code whose owners are fixing it now.

Keyed by ``target/kind`` (a class of mutation). ``cases`` are case indices
(campaign seed 1; case ``i`` of a kind is case ``i`` of a random run that drew
that kind) reproducing each cause found today: ``tests/benchmarks/test_fuzz.py`` replays
them under ``xfail(strict=True)``, so once every cause of a class is fixed the
test passes, the suite fails, and the lead removes the entry here -- from
then on the class is fuzzed in CI like every other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KnownOpen:
    owner: str
    what: str
    cases: tuple[int, ...]



KNOWN_OPEN: dict[str, KnownOpen] = {
}


def known_open(target: str, kind: str) -> str | None:
    """Who is fixing bugs of this class, and what they are (None when the class is not known open)."""
    entry = KNOWN_OPEN.get(f"{target}/{kind}")
    return None if entry is None else f"{entry.owner}: {entry.what}"

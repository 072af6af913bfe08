"""Mirrors: which versions a mirror sends, and the values ``store.mirrors`` returns.

A mirror's selection names runs (names or shell-style globs) and, of their visible versions,
the ones to send: those a named tag points at (``tags``), and those a keep rule of the
retention vocabulary keeps (:mod:`casckpt.retention_rules`: ``keep_last=1`` is the latest,
``keep_every=1000`` the first version of every 1000 steps, ``keep_best`` the best by a
metric; ``keep_tagged=True`` every tagged version). A version is sent if ANY of them selects
it, as retention keeps a version if any rule keeps it; unlike a retention policy, a
selection keeps no tagged version unless asked (``keep_tagged`` is off by default) and may
name tags alone. A mirror evaluates a selection over the visible versions together with
those it recorded that the source deleted since (:mod:`casckpt.store_mirrors`), so a slot
once filled stays filled. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from fnmatch import fnmatchcase
from typing import Any

from casckpt.errors import CatalogError, InvalidArgumentError
from casckpt.jsonable import ToDict
from casckpt.retention_rules import RULES, Candidate, RetentionPolicy, describe, hits

_RULES = {rule.name: rule for rule in RULES}


@dataclass(frozen=True, slots=True)
class MirrorSelection(ToDict):
    """Which versions a mirror sends (see module).

    Attributes:
        runs: run names or globs (``"pretrain-*"``); a version of a run none matches is never sent.
        tags: tag names or globs: the versions they point at are sent.
        rules: keep rules, as a retention policy holds them (``keep_tagged`` off unless asked).
    """

    runs: tuple[str, ...]
    tags: tuple[str, ...] = ()
    rules: RetentionPolicy = RetentionPolicy(keep_tagged=False)

    def matches_run(self, run: str) -> bool:
        """Whether ``run`` is one of the selection's runs."""
        return any(fnmatchcase(run, pattern) for pattern in self.runs)

    def select(self, versions: Sequence[Candidate]) -> dict[str, list[str]]:
        """Of one run's visible ``versions``: version id -> why it is sent, for each it sends."""
        chosen: dict[str, list[str]] = {}
        for v in versions:
            named = [t for t in v.tags if any(fnmatchcase(t, pattern) for pattern in self.tags)]
            if named:
                chosen.setdefault(v.id, []).append(f"tag {', '.join(named)}")
        for version_id, reason in hits(versions, self.rules):
            chosen.setdefault(version_id, []).append(reason)
        return chosen

    def describe(self) -> str:
        """One line: the runs, then the tags and rules as ``casckpt mirror add`` takes them."""
        parts = [f"--run {run}" for run in self.runs] + [f"--tag {tag}" for tag in self.tags]
        rules = describe(self.rules).replace("--no-keep-tagged", "").strip()
        return " ".join(parts + ([rules] if rules else []))

    def to_json(self) -> dict[str, Any]:
        """The catalog's JSON form (``mirrors.selection``)."""
        rules = {k: v for k, v in self.rules.to_dict().items() if v is not None and k != "keep_tagged"}
        if self.rules.keep_tagged:
            rules["keep_tagged"] = True
        return {"runs": list(self.runs), "tags": list(self.tags), "rules": rules}


def make_selection(runs: Sequence[str], tags: Sequence[str] = (), **rules: Any) -> MirrorSelection:
    """A selection from run names or globs, tag names or globs and keep rules by name (those of
    :class:`casckpt.RetentionPolicy`; ``keep_tagged`` is False unless given).

    Raises:
        InvalidArgumentError: no run, nothing that selects a version (no tag, no keep rule),
            an unknown rule or a bad value.
    """
    unknown = sorted(set(rules) - set(_RULES))
    if unknown:
        raise InvalidArgumentError(
            f"a mirror has no rule {', '.join(unknown)}; the rules are {', '.join(_RULES)}")
    runs, tags = tuple(runs), tuple(tags)
    for what, names in (("run", runs), ("tag", tags)):
        bad = [n for n in names if not isinstance(n, str) or not n.strip()]
        if bad:
            raise InvalidArgumentError(f"a mirror's {what} names must be non-empty strings, got {bad!r}")
    if not runs:
        raise InvalidArgumentError("a mirror needs at least one run (a name or a glob: --run 'pretrain-*')")
    policy = RetentionPolicy(**{"keep_tagged": False, **{k: v for k, v in rules.items() if v is not None}})
    if not tags and not policy.keep_tagged and all(
            getattr(policy, rule.name) is None for rule in RULES if rule.keeps_alone):
        raise InvalidArgumentError(
            "a mirror needs something to send: a tag (--tag best), or a keep rule (--keep-last 1 "
            "for the latest, --keep-every 1000 for every 1000th step, --keep-tagged for every "
            "tagged version)")
    return MirrorSelection(runs, tags, policy)


def selection_from_json(data: object, name: str) -> MirrorSelection:
    """Read a selection back from the catalog.

    Raises:
        CatalogError: malformed, or rules this casckpt does not know (upgrade casckpt).
    """
    if not isinstance(data, Mapping) or not isinstance(data.get("rules"), Mapping):
        raise CatalogError(f"the selection of mirror {name!r} is not a JSON object with rules: {data!r}")
    try:
        return make_selection(data.get("runs", ()), data.get("tags", ()), **data["rules"])
    except InvalidArgumentError as exc:
        raise CatalogError(f"the selection of mirror {name!r} is invalid (from a newer casckpt?): {exc}; "
                           "upgrade casckpt, or remove the mirror and add it again") from exc


# -- what store.mirrors returns ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MirrorFailure(ToDict):
    """A version a mirror's last attempt could not send, and why (``error``)."""

    version_id: str
    run: str
    step: int
    at: datetime
    error: str


@dataclass(frozen=True, slots=True)
class MirrorInfo(ToDict):
    """A mirror and where it stands (``store.mirrors.list``, ``casckpt mirror status``).

    Attributes:
        name: its name in this (the source) store.
        destination: the destination store's directory (absolute).
        key_file: the destination's master key file, if it is encrypted.
        selection: which versions it sends.
        propagate_deletions: versions deleted here are deleted there too by its runs.
        created_at: when it was added.
        last_run_at, last_finished_at: when its last run started and ended (None: never ran, or
            still running).
        last_error: what stopped its last run (the destination could not be opened, ...); None:
            nothing did.
        versions_sent: versions the destination holds through it.
        bytes_sent: raw bytes it sent.
        failed: the versions whose copy failed at their last attempt, with why, that still
            matter: selected at the mirror's last run (a failure no longer selected -- untagged,
            deleted here -- is recorded ``unselected`` by the next run and not shown).
    """

    name: str
    destination: str
    key_file: str | None
    selection: MirrorSelection
    propagate_deletions: bool
    created_at: datetime
    last_run_at: datetime | None = None
    last_finished_at: datetime | None = None
    last_error: str | None = None
    versions_sent: int = 0
    bytes_sent: int = 0
    failed: tuple[MirrorFailure, ...] = ()


@dataclass(frozen=True, slots=True)
class MirroredVersion(ToDict):
    """One version of a mirror run.

    Attributes:
        source_id, id: its ids here and at the destination (another one across keys; empty when
            unknown: a failure, a dry run across keys).
        run, step: where it is.
        status: ``sent`` (published there by this run), ``present`` (the destination held it),
            ``would send`` (a dry run), ``failed`` (``error`` says why), ``deleted`` (deleted here,
            and there as the mirror asks; ``would delete``: a dry run's), ``gone`` (the
            destination held it through this mirror, and no longer shows it: deleted there since,
            by its retention or by hand, or purged by its gc; it is not sent again, and checked
            again at each run).
        chunks, bytes: chunks and raw bytes sent for it (with its missing ancestors).
        reasons: why the selection picked it.
    """

    source_id: str
    id: str
    run: str
    step: int
    status: str
    chunks: int = 0
    bytes: int = 0
    reasons: tuple[str, ...] = ()
    error: str | None = None


@dataclass(frozen=True, slots=True)
class MirrorReport(ToDict):
    """What one run of a mirror did (``store.mirrors.push``, ``casckpt mirror run``).

    Attributes:
        mirror, destination: which mirror, into which store (credentials redacted).
        versions: every version it selected (and deleted), by run and step.
        chunks, bytes: chunks and raw bytes sent in all.
        tags: tags set or moved at the destination.
        dry_run: nothing was written, here or there.
        seconds: wall time.
        stale_tags: tags here on a version ``gone`` at the destination that there still point
            at another version: no run can move them (it does not send the version again);
            undelete the version there (the next run moves them) or tag another one there.
    """

    mirror: str
    destination: str
    versions: tuple[MirroredVersion, ...] = ()
    chunks: int = 0
    bytes: int = 0
    tags: tuple[str, ...] = ()
    dry_run: bool = False
    seconds: float = 0.0
    stale_tags: tuple[str, ...] = ()

    @property
    def failed(self) -> tuple[MirroredVersion, ...]:
        """The versions that could not be sent."""
        return tuple(v for v in self.versions if v.status == "failed")

    @property
    def nothing_sent(self) -> bool:
        """Nothing sent, nothing failed, no tag left behind: the destination held every
        selected version (or deleted it since, ``gone``)."""
        return (all(v.status in ("present", "gone") for v in self.versions)
                and not self.tags and not self.stale_tags)

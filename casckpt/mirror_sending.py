"""One run of a mirror (:mod:`casckpt.store_mirrors`) into its destination: the copies of the
versions it selected, each outcome recorded as it is known.

:class:`Sending` copies the chosen versions with :meth:`casckpt.Store.copy` (all at once, or
one by one when that fails or on a thread), leaves out those the destination deleted since
(``gone``; their tags that point at another version there are reported, ``stale_tags``),
undeletes there what this mirror deleted there and the source shows again, and, for a mirror
that propagates deletions, deletes there what it sent that the source deleted. :class:`Slot`
is a recorded version the source no longer shows, as the keep rules read it (the sticky
selection).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

from casckpt.catalog import mirrors as mirror_sql
from casckpt.catalog.mirrors import MirrorRow, VersionOutcome
from casckpt.errors import CasckptError, RefNotFoundError
from casckpt.mirror_rules import MirroredVersion
from casckpt.storage import redact_url
from casckpt.store_core import StoreCore
from casckpt.types import CopiedVersion, CopyReport, ProgressCallback, RunInfo, Version

log = logging.getLogger(__name__)


class MirrorEnd(Protocol):
    """What a mirror reads and writes of a store (:class:`casckpt.Store` is one)."""

    def copy(self, refs: Any, to: Any, *, dry_run: bool = ..., progress: ProgressCallback | None = ...,
             lineage: bool = ...) -> CopyReport: ...
    def log(self, run: str | None = ..., *, limit: int | None = ..., order: str = ...) -> list[Version]: ...
    def runs(self) -> list[RunInfo]: ...
    @property
    def _core(self) -> StoreCore: ...
    def resolve(self, ref: Any) -> Version: ...
    def delete(self, ref: Any, reason: str = ...) -> Version: ...
    def undelete(self, ref: Any) -> Version: ...
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Slot:
    """A version this mirror recorded that is no longer visible here, as the keep rules read it
    (:class:`casckpt.retention_rules.Candidate`): it still holds its slot."""

    id: str
    step: int
    created_at: datetime
    metrics: Mapping[str, float]
    tags: tuple[str, ...] = ()

    @classmethod
    def of(cls, outcome: VersionOutcome) -> Slot:
        metrics = json.loads(outcome.metrics) if outcome.metrics else {}
        when = outcome.created_at if outcome.created_at is not None else outcome.at
        return cls(outcome.version_id, outcome.step, datetime.fromtimestamp(when, timezone.utc), metrics)


def _by_step(versions: list[MirroredVersion]) -> list[MirroredVersion]:
    return sorted(versions, key=lambda v: (v.run, v.step))


class Sending:
    """One mirror run's copies into its destination, each outcome recorded as it is known (none
    by a dry run). Call :meth:`send`, then, for a mirror that propagates deletions,
    :meth:`propagate_deletions`; ``stale_tags`` then lists the tags :meth:`send` could not move
    there (their version is ``gone`` there). One run's, on the thread of that run."""

    def __init__(self, core: StoreCore, row: MirrorRow, source: MirrorEnd, dest: MirrorEnd, dry_run: bool,
                 progress: ProgressCallback | None, stopping: Callable[[], bool] | None) -> None:
        self.core, self.row, self.name, self.source, self.dest = core, row, row.name, source, dest
        self.dry_run, self.progress, self.stopping = dry_run, progress, stopping
        self.versions: dict[str, Version] = {}
        self.before: dict[str, VersionOutcome] = {}
        self.carried: dict[str, str] = {}
        self.stale_tags: list[str] = []

    def _stop(self) -> bool:
        return self.stopping is not None and self.stopping()

    def send(self, chosen: Sequence[tuple[Version, tuple[str, ...]]],
             ) -> tuple[list[MirroredVersion], list[str]]:
        """Copy the ``chosen`` versions: all at once in the foreground, or, when that fails and
        on a thread (which stops between versions), one by one, so one failure stops no other
        version. A version the destination deleted (its catalog shows it deleted: its retention,
        or by hand) is not sent again (``gone``); one it has no record of (wiped, replaced) is.
        Returns what became of each, and the tags set there."""
        self.versions = {v.id: v for v, _ in chosen}
        self._undelete_there(chosen)
        gone, chosen = self._gone_there(chosen)
        if not chosen:
            return gone, []
        why = {v.id: reasons for v, reasons in chosen}
        if self.stopping is None:
            try:
                report = self._copy([v.id for v, _ in chosen])
            except CasckptError:
                pass
            else:
                return _by_step(gone + self._record(report.versions, why)), list(report.tags)
        out: list[MirroredVersion] = list(gone)
        tags: list[str] = []
        for version, reasons in chosen:
            if self._stop():
                break
            try:
                report = self._copy([version.id])
            except CasckptError as exc:
                out.append(self._failed(version, reasons, exc))
                continue
            out += self._record(report.versions, why)
            tags += report.tags
        return _by_step(out), tags

    def _gone_there(self, chosen: Sequence[tuple[Version, tuple[str, ...]]],
                    ) -> tuple[list[MirroredVersion], list[tuple[Version, tuple[str, ...]]]]:
        """Split off the versions the destination deleted since this mirror sent them (or found
        them there): its catalog shows them deleted, or -- the same store, by its identity --
        its gc purged them. Checked again each run: a ``gone`` version shown again is held,
        and a destination of another identity (wiped and made again, replaced) has none."""
        store_id = self.dest._core.catalog.store_id
        if self.dry_run:
            replaced = self.row.dest_store_id not in (None, store_id)
        else:
            replaced = mirror_sql.ran_into(self.core.catalog, self.name, self.row.created_at, store_id)
        self.before = {} if replaced else {
            o.version_id: o for o in mirror_sql.outcomes(self.core.catalog, self.name)
            if o.state in ("sent", "present", "gone") or (o.state == "failed" and o.owned)}
        self.carried = {} if replaced else mirror_sql.carried(self.core.catalog, self.name)
        gone: list[MirroredVersion] = []
        rest = []
        for version, reasons in chosen:
            outcome = self.before.get(version.id)
            dest_id = (outcome.dest_id or outcome.version_id) if outcome is not None else ""
            if outcome is not None and self._deleted_there(dest_id):
                stale = self._stale_tags(version, dest_id)
                gone.append(MirroredVersion(version.id, outcome.dest_id or "", version.run, version.step,
                                            "gone", reasons=(*reasons, "deleted at the destination", *stale)))
                if outcome.state != "gone" and not self.dry_run:
                    mirror_sql.record(self.core.catalog, self.name, self.row.created_at, [outcome._replace(
                        state="gone", chunks=0, bytes=0, at=time.time())])
            else:
                rest.append((version, reasons))
        return gone, rest

    def _stale_tags(self, version: Version, dest_id: str) -> list[str]:
        """Why each tag of ``version`` here (gone at the destination: no copy carries them) is
        reported (recorded in ``stale_tags``): a tag whose destination tag does not point at the
        version's copy, and that changed here since this mirror last carried it (or that it never
        carried) -- a tag it carried onto this version, then moved there by the destination's
        owner, is theirs to choose. Cleared by undeleting the version there (the next run carries
        the tag) or by moving or removing the tag here."""
        out = []
        for tag in version.tags:
            if self.carried.get(tag) == version.id:
                continue
            try:
                there = self.dest.resolve(f"tag:{tag}")
            except RefNotFoundError:  # not there, or on a version deleted there
                where = "is not there or names a deleted version"
            else:
                if there.id == dest_id:
                    continue
                where = f"points at {there.run}@{there.step}"
            self.stale_tags.append(tag)
            out.append(f"tag {tag} not carried there (it {where}): undelete {version.run}@{version.step} "
                       f"there, or move or remove the tag here")
            log.warning("mirror %s: tag %s names %s@%d here, gone at the destination, where the tag %s: "
                        "undelete the version there (the next run carries the tag), or move or remove the "
                        "tag here", self.name, tag, version.run, version.step, where)
        return out

    def _undelete_there(self, chosen: Sequence[tuple[Version, tuple[str, ...]]]) -> None:
        """Undelete at the destination each chosen version this mirror deleted there (state
        ``deleted``: propagated) that the source shows again (undeleted here): a copy would
        find the deleted version in its place. One the destination's gc swept meanwhile is
        sent again by the copy."""
        deleted = {o.version_id: o for o in mirror_sql.outcomes(self.core.catalog, self.name, "deleted")}
        for version, _ in chosen:
            outcome = deleted.get(version.id)
            if outcome is None or not outcome.owned or self.dry_run:  # one it deleted there itself
                continue
            try:
                self.dest.undelete(outcome.dest_id or outcome.version_id)
            except CasckptError as exc:  # swept there, or undeleted by hand: the copy decides
                log.info("mirror %s: %s@%d not undeleted at the destination (%s)", self.name,
                         version.run, version.step, exc)
            mirror_sql.record(self.core.catalog, self.name, self.row.created_at, [outcome._replace(
                state="sent", chunks=0, bytes=0, at=time.time())])

    def _deleted_there(self, version_id: str) -> bool:
        """Whether the destination, which held ``version_id``, no longer shows it: deleted
        there (its catalog says so) or purged since by its gc."""
        try:
            self.dest.resolve(version_id)
        except RefNotFoundError:
            return True
        return False

    def _copy(self, refs: list[str]) -> CopyReport:
        return self.source.copy(refs, to=self.dest, dry_run=self.dry_run, progress=self.progress,
                                lineage=False)

    def _record(self, copied: Iterable[CopiedVersion],
                why: dict[str, tuple[str, ...]]) -> list[MirroredVersion]:
        out, rows = [], []
        copied_list = list(copied)
        for v in copied_list:
            status = ("would send" if self.dry_run else "sent") if v.sent else "present"
            out.append(MirroredVersion(v.source_id, v.id, v.run, v.step, status, v.chunks, v.bytes,
                                       why.get(v.source_id, ())))
            before = self.before.get(v.source_id)
            # sent by this mirror (now or by an earlier run): its to delete; present: never
            mine = v.sent or (before is not None and before.owned)
            version = self.versions.get(v.source_id)
            rows.append(VersionOutcome(
                v.source_id, v.run, v.step, "sent" if mine else "present", v.id or None, v.chunks, v.bytes,
                time.time(), None, version.created_at.timestamp() if version else None,
                json.dumps(dict(version.metrics), sort_keys=True) if version else None, v.sent))
        if not self.dry_run:
            mirror_sql.record(self.core.catalog, self.name, self.row.created_at, rows)
            # the copy set the source's tags of each version there: carried, as they are now
            mirror_sql.carry(self.core.catalog, self.name, self.row.created_at, {
                tag: v.source_id for v in copied_list for tag in self._tags_of(v.source_id)})
        return out

    def _tags_of(self, version_id: str) -> tuple[str, ...]:
        version = self.versions.get(version_id)
        return tuple(version.tags) if version is not None else ()

    def _failed(self, version: Version, reasons: tuple[str, ...], exc: CasckptError) -> MirroredVersion:
        error = f"{type(exc).__name__}: {redact_url(str(exc))}"
        log.warning("mirror %s: %s@%d was not sent: %s", self.name, version.run, version.step, error)
        if not self.dry_run:
            mirror_sql.record(self.core.catalog, self.name, self.row.created_at, [
                VersionOutcome(version.id, version.run, version.step, "failed", None, 0, 0, time.time(),
                               error)])
        return MirroredVersion(version.id, "", version.run, version.step, "failed", reasons=reasons,
                               error=error)

    def propagate_deletions(self) -> list[MirroredVersion]:
        """Delete at the destination each version this mirror sent (``sent``, or ``failed`` to
        send again since: still its own) that is deleted here (a dry run deletes nothing and
        says ``would delete``)."""
        out = []
        for sent in mirror_sql.outcomes(self.core.catalog, self.name):
            if sent.state not in ("sent", "failed") or not sent.owned:  # only what it sent there
                continue  # (not what it found present, nor what it sent into a store since replaced)
            if self._stop():
                break
            try:
                self.source.resolve(sent.version_id)
                continue
            except RefNotFoundError:
                pass
            if not self.dry_run:
                try:
                    self.dest.delete(sent.dest_id or sent.version_id,
                                     reason=f"mirror {self.name}: deleted at the source")
                except RefNotFoundError:  # deleted there already
                    pass
                mirror_sql.record(self.core.catalog, self.name, self.row.created_at, [sent._replace(
                    state="deleted", chunks=0, bytes=0, at=time.time())])
            out.append(MirroredVersion(sent.version_id, sent.dest_id or "", sent.run, sent.step,
                                       "would delete" if self.dry_run else "deleted",
                                       reasons=("deleted at the source",)))
        return out

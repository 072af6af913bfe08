"""``store.mirrors``: named policies that keep another store up to date with selected versions.

A mirror lives in the SOURCE store's catalog (migrations 0016, 0017): a name, the
destination (a store's directory, as ``casckpt.open`` takes it, and its key file when
encrypted), a selection (:mod:`casckpt.mirror_rules`:
runs, tags, keep rules of the retention vocabulary) and whether deletions propagate. A run
of the mirror (``store.mirrors.push``, ``casckpt mirror run`` from cron, or a
:class:`MirrorWorker` thread of a training job) opens the destination, selects the versions
now (sticky: a version it recorded still holds its slot under the keep rules once the
source deleted it), and copies them with :meth:`casckpt.Store.copy` without their lineage (exactly the
selected versions; the copy sends only the chunks the destination lacks, so a run again
sends nothing), which also moves the source's tags on them there. Each version's outcome is
recorded as it is known (``mirror_versions``): a version that fails is recorded with why and
does not stop the others; a destination that cannot be opened stops the run with
:class:`~casckpt.errors.MirrorDestinationError`, recorded on the mirror. The destination's
own retention and gc apply there (a version it deleted is ``gone``, not sent again; a
destination of another store identity, wiped or replaced, gets every version again); a
mirror deletes nothing there unless it was added with ``propagate_deletions``, and then
only versions it sent (not those the destination held already) that are deleted here.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

from casckpt import config as cfg
from casckpt.catalog import mirrors as mirror_sql
from casckpt.catalog.grants import missing_of
from casckpt.catalog.locks import mirror_lock
from casckpt.catalog.mirrors import MirrorRow, VersionOutcome
from casckpt.engine.versions import records
from casckpt.engine.versions.validate import check_name
from casckpt.errors import (
    AccessDeniedError,
    CasckptError,
    InvalidArgumentError,
    MirrorDestinationError,
    NotAStoreError,
    RefNotFoundError,
)
from casckpt.mirror_rules import (
    MirroredVersion,
    MirrorFailure,
    MirrorInfo,
    MirrorReport,
    MirrorSelection,
    make_selection,
    selection_from_json,
)
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


Opener = Callable[[str, "str | None", bool], MirrorEnd]
"""``(destination, key file, create) -> the destination store, open`` (``casckpt.open``'s way)."""


def _utc(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, timezone.utc)


class Mirrors:
    """The mirrors of one open store (``store.mirrors``); thread-safe as the store is.

    ``source`` is the store itself, ``opener`` opens a destination (see :data:`Opener`).
    """

    def __init__(self, core: StoreCore, source: MirrorEnd, opener: Opener | None) -> None:
        self._core, self._source, self._opener = core, source, opener
        self._workers: list[MirrorWorker] = []
        self._lock = threading.Lock()

    def add(self, name: str, to: str, *, runs: Sequence[str], tags: Sequence[str] = (),
            key_file: str | None = None, propagate_deletions: bool = False, **rules: Any) -> MirrorInfo:
        """Add mirror ``name``, which keeps store ``to`` up to date with the selected versions
        of this store's ``runs`` (names or globs): those ``tags`` (names or globs) point at and
        those the keep ``rules`` select (the retention rules by name: ``keep_last=1`` the
        latest, ``keep_every=1000`` every 1000th step, ``keep_best=("loss", 1, "min")``,
        ``keep_tagged=True`` every tagged version). Nothing is sent until it runs
        (:meth:`push`, ``casckpt mirror run``, :meth:`start`).

        Args:
            to: the destination store's directory (made absolute; created by the first run if
                missing). A store on remote storage is named by its directory too, whose
                casckpt.toml names its locations and catalog, as ``casckpt.open`` takes it.
            key_file: the destination's master key file, if it is encrypted (its path is kept).
                It alone keys the destination: ``CASCKPT_KEY_FILE`` (the source's key) is never
                used for it, so a mirror without one makes and opens an unencrypted store.
            propagate_deletions: a version this mirror sent that is then deleted here is
                deleted there by the next run (default: never deleted there).

        Raises:
            InvalidNameError: bad mirror name.
            InvalidArgumentError: a mirror of that name exists, no run, nothing selected,
                an unknown rule or a bad value; ``to`` is a URL, not a directory, or this store's
                own directory (or a link to it; a run would refuse it anyway: a store is never
                copied into itself).
        """
        self._core.refuse_write("store.mirrors.add", "the catalog")
        check_name(name, "mirror")
        if not isinstance(to, str) or not to:
            raise InvalidArgumentError(f"a mirror's destination is a store's directory, got {to!r}")
        selection = make_selection(runs, tags, **rules)
        to = os.path.abspath(cfg.check_store_path(to))  # absolute: a run from cron starts elsewhere
        root = self._core.root
        if root is not None and (os.path.realpath(to) == os.path.realpath(root) or (
                os.path.exists(to) and os.path.samefile(to, root))):
            raise InvalidArgumentError(
                f"a mirror's destination is another store; {to} is this store itself (its directory, "
                "or a link to it): name another directory")
        key_file = None if key_file is None else os.path.abspath(key_file)
        mirror_sql.add(self._core.catalog, MirrorRow(
            name, to, key_file, selection.to_json(), propagate_deletions, time.time(), None, None, None),
            redact_url(to))
        records.record_mirror(self._core.locations, self._core.catalog, name)  # for a catalog rebuild
        return self.get(name)

    def remove(self, name: str) -> None:
        """Forget mirror ``name`` and what it recorded; the destination is left as it is.

        Raises:
            RefNotFoundError: there is no such mirror.
            AccessDeniedError: these credentials may not delete its rows (the writer role:
                removing a mirror is the admin's).
        """
        self._core.refuse_write("store.mirrors.remove", "the catalog")
        row = mirror_sql.mirrors(self._core.catalog, name)[0]
        missing = missing_of(self._core.catalog, [("mirrors", "DELETE"), ("mirror_versions", "DELETE")])
        if missing:
            raise AccessDeniedError(
                f"removing mirror {name!r} needs {missing[0]} in the catalog, which these credentials "
                "lack (a writer runs mirrors, the admin removes them); nothing was changed: run it "
                "with the admin role's credentials (`casckpt init --print-grants admin`)", right=missing[0])
        mirror_sql.remove(self._core.catalog, name, redact_url(row.destination))
        records.drop_mirror(self._core.locations, self._core.catalog, name)

    def get(self, name: str) -> MirrorInfo:
        """Mirror ``name`` and where it stands.

        Raises:
            RefNotFoundError: there is no such mirror.
        """
        return self._info(mirror_sql.mirrors(self._core.catalog, name)[0])

    def list(self) -> list[MirrorInfo]:
        """Every mirror of this store, by name, and where each stands."""
        totals = mirror_sql.totals(self._core.catalog)
        return [self._info(row, totals) for row in mirror_sql.mirrors(self._core.catalog)]

    def _info(self, row: MirrorRow, totals: dict[str, mirror_sql.MirrorTotals] | None = None) -> MirrorInfo:
        sent = (totals if totals is not None else mirror_sql.totals(self._core.catalog)).get(row.name)
        failed = tuple(MirrorFailure(o.version_id, o.run, o.step, _utc(o.at) or datetime.now(timezone.utc),
                                     o.error or "")
                       for o in mirror_sql.outcomes(self._core.catalog, row.name, "failed"))
        return MirrorInfo(
            row.name, redact_url(row.destination), row.key_file, selection_from_json(row.selection, row.name),
            row.propagate_deletions, _utc(row.created_at) or datetime.now(timezone.utc),
            _utc(row.run_started_at), _utc(row.run_finished_at), row.run_error,
            sent.versions if sent else 0, sent.bytes if sent else 0, failed)

    # -- running ----------------------------------------------------------------------------

    def push(self, name: str, *, dry_run: bool = False,
             progress: ProgressCallback | None = None) -> MirrorReport:
        """Run mirror ``name`` once: send the versions its selection picks now that the
        destination lacks, move the tags on them there, and (if the mirror propagates
        deletions) delete there the versions it sent that were deleted here. Each version's
        outcome is recorded as it is known; one that fails (``report.failed``, with why) does
        not stop the others. Idempotent: a run again sends nothing (``report.nothing_sent``).

        Args:
            dry_run: say what would be sent; write nothing, here or there.
            progress: called with ``("copy", bytes sent, bytes to send)``.

        Raises:
            RefNotFoundError: there is no such mirror.
            MirrorDestinationError: the destination could not be opened (recorded on the mirror).
            ReadOnlyStoreError: this store is read-only (unless ``dry_run``).
        """
        return self._run(mirror_sql.mirrors(self._core.catalog, name)[0], dry_run, progress, None)

    def push_all(self, *, dry_run: bool = False,
                 progress: ProgressCallback | None = None) -> builtins.list[MirrorReport]:
        """Run every mirror, by name (see :meth:`push`); a destination that cannot be opened is
        recorded and the other mirrors still run, then the first such error is raised.

        Raises:
            MirrorDestinationError: a destination could not be opened (after the others ran).
        """
        reports, errors = [], []
        for row in mirror_sql.mirrors(self._core.catalog):
            try:
                reports.append(self._run(row, dry_run, progress, None))
            except MirrorDestinationError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        return reports

    def _run(self, row: MirrorRow, dry_run: bool, progress: ProgressCallback | None,
             stopping: Callable[[], bool] | None) -> MirrorReport:
        """One run (see :meth:`push`); ``stopping``: a thread's stop flag (versions then go one by
        one, the flag read between them), None in the foreground. A run (not a dry run) holds
        the mirror's run lock: a second run of it, here or in another process, waits for the
        first, then finds its work done."""
        if dry_run:
            return self._run_held(row, dry_run, progress, stopping)
        self._core.refuse_write("a mirror run", "the catalog")
        with mirror_lock(self._core.catalog, row.name):
            return self._run_held(row, dry_run, progress, stopping)

    def _run_held(self, row: MirrorRow, dry_run: bool, progress: ProgressCallback | None,
                  stopping: Callable[[], bool] | None) -> MirrorReport:
        started = time.monotonic()
        selection = selection_from_json(row.selection, row.name)
        chosen = self._chosen(row, selection)
        if not dry_run:
            mirror_sql.run_started(self._core.catalog, row.name, row.created_at)
        error: str | None = None
        try:
            dest = self._open(row, create=not dry_run)
            if dest is None:  # a dry run before the first: the destination is not made yet
                return MirrorReport(row.name, redact_url(row.destination), tuple(
                    MirroredVersion(v.id, "", v.run, v.step, "would send", 0, v.logical_bytes, reasons)
                    for v, reasons in chosen), 0, sum(v.logical_bytes for v, _ in chosen), (), True,
                    time.monotonic() - started)
            try:
                sending = _Sending(self._core, row, self._source, dest, dry_run, progress, stopping)
                versions, tags = sending.send(chosen)
                if row.propagate_deletions:
                    versions += sending.propagate_deletions()
            finally:
                dest.close()
        except BaseException as exc:
            error = redact_url(str(exc)) or type(exc).__name__
            raise
        finally:
            if not dry_run:
                mirror_sql.run_finished(self._core.catalog, row.name, row.created_at, error)
        return MirrorReport(row.name, redact_url(row.destination), tuple(versions),
                            sum(v.chunks for v in versions), sum(v.bytes for v in versions), tuple(tags),
                            dry_run, time.monotonic() - started)

    def _chosen(self, row: MirrorRow, selection: MirrorSelection,
                ) -> builtins.list[tuple[Version, tuple[str, ...]]]:
        """The versions ``selection`` picks now, by run name and step, with why. Sticky: the
        versions this mirror recorded (sent, present, gone, deleted) that are no longer visible
        here still hold their slot under the rules, so the source's own retention deleting the
        first version of a 1000-step range makes the next one no "first" (nor the next best,
        the next first of its day). Only visible versions are picked."""
        recorded = [o for o in mirror_sql.outcomes(self._core.catalog, row.name)
                    if o.state in ("sent", "present", "gone", "deleted")]
        out = []
        for run in sorted(self._source.runs(), key=lambda r: r.name):
            if selection.matches_run(run.name):
                versions = self._source.log(run.name, limit=None, order="asc")
                visible = {v.id for v in versions}
                held = [_Slot.of(o) for o in recorded if o.run == run.name and o.version_id not in visible]
                picked = selection.select(sorted([*versions, *held], key=lambda v: v.step))
                out += [(v, tuple(picked[v.id])) for v in versions if v.id in picked]
        return out

    def _open(self, row: MirrorRow, *, create: bool) -> MirrorEnd | None:
        """The destination, open; None where ``create`` is False and there is no store yet."""
        where = redact_url(row.destination)
        if self._opener is None:
            raise MirrorDestinationError(f"mirror {row.name!r}: this store handle cannot open other stores; "
                                         "open the store with casckpt.open")
        try:
            return self._opener(row.destination, row.key_file, create)
        except (CasckptError, OSError) as exc:
            if not create and isinstance(exc, NotAStoreError):
                return None
            raise MirrorDestinationError(
                f"mirror {row.name!r}: its destination {where} could not be opened ({type(exc).__name__}: "
                f"{redact_url(str(exc))}). Check that it is reachable and that its URL, credentials and key "
                f"file are right, then run the mirror again (casckpt mirror run {row.name}); or remove the "
                f"mirror (casckpt mirror remove {row.name})") from exc

    # -- in the background ------------------------------------------------------------------

    def start(self, name: str, *, interval: float = 300.0, poll: float | None = 5.0) -> MirrorWorker:
        """Run mirror ``name`` on a thread of this process: at once; then after commits (a run
        of the store has a new latest version, by any process: checked every ``poll``
        seconds, one catalog query; None: not checked); every ``interval`` seconds (tags that
        moved); and whenever :meth:`MirrorWorker.wake` is called -- until
        :meth:`MirrorWorker.stop`, the store closes (which waits for the version being
        sent, then stops) or the mirror is removed (the worker stops after the version being
        sent, and its run records nothing more). A failed run -- whatever its error (a
        CasckptError, an OSError such as ENOSPC, ...; not KeyboardInterrupt or SystemExit) --
        is logged (WARNING) and recorded on the mirror and the worker (``last_error``); the
        thread lives on and the next run tries again.

        Raises:
            RefNotFoundError: there is no such mirror.
            InvalidArgumentError: ``interval`` or ``poll`` is not a positive number of seconds;
                the store is closed.
            ReadOnlyStoreError: this store is read-only.
        """
        if self._core.closed:  # close() stops the workers: one started after would run on
            raise InvalidArgumentError(f"this store is closed: open it again (casckpt.open) to run "
                                       f"mirror {name!r} in the background")
        self._core.refuse_write("store.mirrors.start", "the catalog")
        row = mirror_sql.mirrors(self._core.catalog, name)[0]
        for what, value in (("interval", interval), ("poll", 1.0 if poll is None else poll)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9:
                raise InvalidArgumentError(
                    f"a mirror's {what} is a positive number of seconds, got {value!r}")
        worker = MirrorWorker(self, row, float(interval), None if poll is None else float(poll))
        with self._lock:
            self._workers = [w for w in self._workers if w.is_alive()] + [worker]
        worker.start()
        return worker

    def stop_all(self) -> None:
        """Stop every :class:`MirrorWorker` of this store and wait for them (``Store.close``)."""
        with self._lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.stop()

    def _latest(self) -> tuple[tuple[str, str | None], ...] | None:
        """Each run's latest version (None: the catalog could not say): what a new commit changes."""
        try:
            return tuple((r.name, r.latest_id) for r in self._source.runs())
        except Exception as exc:  # any: the worker thread polls with it and must live on
            log.debug("mirrors: the runs could not be read (%s: %s)", type(exc).__name__, exc)
            return None

    def _background_run(self, name: str, generation: float,
                        stopping: Callable[[], bool]) -> MirrorReport | None:
        """A worker's run of mirror ``name`` of that ``generation``; None when it was removed,
        before or during the run (or removed and added again: another mirror): the worker
        then stops. Between versions
        the run stops too once it is removed."""
        if not mirror_sql.exists(self._core.catalog, name, generation):
            return None
        row = mirror_sql.mirrors(self._core.catalog, name)[0]

        def removed_or_stopping() -> bool:
            return stopping() or not mirror_sql.exists(self._core.catalog, name, generation)

        report = self._run(row, False, None, removed_or_stopping)
        return report if mirror_sql.exists(self._core.catalog, name, generation) else None


class MirrorWorker(threading.Thread):
    """A thread running one mirror again and again (:meth:`Mirrors.start`).

    Attributes:
        mirror: the mirror's name.
        interval: seconds between runs.
        poll: seconds between checks for new commits (None: none).
        runs: runs finished (failed ones too).
        last_report: the last run's report (None: none finished).
        last_error: the error of the last run that failed (None: the last one did not).
    """

    def __init__(self, mirrors: Mirrors, row: MirrorRow, interval: float, poll: float | None) -> None:
        super().__init__(name=f"casckpt-mirror-{row.name}", daemon=True)
        self._mirrors, self.mirror, self.interval, self.poll = mirrors, row.name, interval, poll
        self._generation = row.created_at
        self._stop_event, self._wake = threading.Event(), threading.Event()
        self.runs = 0
        self.last_report: MirrorReport | None = None
        self.last_error: BaseException | None = None

    def run(self) -> None:  # the thread's body
        while not self._stop_event.is_set():
            self._wake.clear()
            seen = self._mirrors._latest() if self.poll is not None else None
            try:
                report = self._mirrors._background_run(self.mirror, self._generation,
                                                       self._stop_event.is_set)
                if report is None:
                    log.info("mirror %s was removed: its worker stops", self.mirror)
                    return
                self.last_report, self.last_error = report, None
            except Exception as exc:  # any: ENOSPC, a driver's error; the thread must live on
                self.last_error = exc
                log.warning("mirror %s: the run failed (%s: %s); the next one tries again",
                            self.mirror, type(exc).__name__, redact_url(str(exc)),
                            exc_info=not isinstance(exc, CasckptError))
            self.runs += 1
            self._until_due(seen, time.monotonic() + self.interval)

    def _until_due(self, seen: object, deadline: float) -> None:
        """Wait for a wake, a stop, the interval's end or (polling) a new commit."""
        while not self._stop_event.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or self._wake.wait(left if self.poll is None else min(left, self.poll)):
                return
            if self.poll is not None and self._mirrors._latest() not in (None, seen):
                return

    def wake(self) -> None:
        """Run the mirror now (once the run in progress, if any, is over)."""
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the version being sent, and wait for the thread (at most ``timeout``
        seconds). Idempotent."""
        self._stop_event.set()
        self._wake.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)


@dataclass(frozen=True, slots=True)
class _Slot:
    """A version this mirror recorded that is no longer visible here, as the keep rules read it
    (:class:`casckpt.retention_rules.Candidate`): it still holds its slot."""

    id: str
    step: int
    created_at: datetime
    metrics: Mapping[str, float]
    tags: tuple[str, ...] = ()

    @classmethod
    def of(cls, outcome: VersionOutcome) -> _Slot:
        metrics = json.loads(outcome.metrics) if outcome.metrics else {}
        when = outcome.created_at if outcome.created_at is not None else outcome.at
        return cls(outcome.version_id, outcome.step, datetime.fromtimestamp(when, timezone.utc), metrics)


def _by_step(versions: list[MirroredVersion]) -> list[MirroredVersion]:
    return sorted(versions, key=lambda v: (v.run, v.step))


class _Sending:
    """One mirror run's copies into its destination, each outcome recorded as it is known."""

    def __init__(self, core: StoreCore, row: MirrorRow, source: MirrorEnd, dest: MirrorEnd, dry_run: bool,
                 progress: ProgressCallback | None, stopping: Callable[[], bool] | None) -> None:
        self.core, self.row, self.name, self.source, self.dest = core, row, row.name, source, dest
        self.dry_run, self.progress, self.stopping = dry_run, progress, stopping
        self.versions: dict[str, Version] = {}
        self.before: dict[str, VersionOutcome] = {}

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
            if o.state in ("sent", "present", "gone")}
        gone: list[MirroredVersion] = []
        rest = []
        for version, reasons in chosen:
            outcome = self.before.get(version.id)
            if outcome is not None and self._deleted_there(outcome.dest_id or outcome.version_id):
                gone.append(MirroredVersion(version.id, outcome.dest_id or "", version.run, version.step,
                                            "gone", reasons=(*reasons, "deleted at the destination")))
                if outcome.state != "gone" and not self.dry_run:
                    mirror_sql.record(self.core.catalog, self.name, self.row.created_at, [outcome._replace(
                        state="gone", chunks=0, bytes=0, at=time.time())])
            else:
                rest.append((version, reasons))
        return gone, rest

    def _undelete_there(self, chosen: Sequence[tuple[Version, tuple[str, ...]]]) -> None:
        """Undelete at the destination each chosen version this mirror deleted there (state
        ``deleted``: propagated) that the source shows again (undeleted here): a copy would
        find the deleted version in its place. One the destination's gc swept meanwhile is
        sent again by the copy."""
        deleted = {o.version_id: o for o in mirror_sql.outcomes(self.core.catalog, self.name, "deleted")}
        for version, _ in chosen:
            outcome = deleted.get(version.id)
            if outcome is None or self.dry_run:
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
        for v in copied:
            status = ("would send" if self.dry_run else "sent") if v.sent else "present"
            out.append(MirroredVersion(v.source_id, v.id, v.run, v.step, status, v.chunks, v.bytes,
                                       why.get(v.source_id, ())))
            before = self.before.get(v.source_id)
            # sent by this mirror (now or by an earlier run): its to delete; present: never
            mine = v.sent or (before is not None and before.state in ("sent", "gone"))
            version = self.versions.get(v.source_id)
            rows.append(VersionOutcome(
                v.source_id, v.run, v.step, "sent" if mine else "present", v.id or None, v.chunks, v.bytes,
                time.time(), None, version.created_at.timestamp() if version else None,
                json.dumps(dict(version.metrics), sort_keys=True) if version else None))
        if not self.dry_run:
            mirror_sql.record(self.core.catalog, self.name, self.row.created_at, rows)
        return out

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
        """Delete at the destination each version this mirror sent that is deleted here."""
        out = []
        for sent in mirror_sql.outcomes(self.core.catalog, self.name, "sent"):
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
            out.append(MirroredVersion(sent.version_id, sent.dest_id or "", sent.run, sent.step, "deleted",
                                       reasons=("deleted at the source",)))
        return out

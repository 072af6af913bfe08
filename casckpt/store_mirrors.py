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

This module holds the mirrors' definitions and runs; :mod:`casckpt.mirror_sending` one run's
copies into the destination, :mod:`casckpt.mirror_worker` the background thread.
"""

from __future__ import annotations

import builtins
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

from casckpt import config as cfg
from casckpt.catalog import mirrors as mirror_sql
from casckpt.catalog.grants import missing_of
from casckpt.catalog.locks import mirror_lock
from casckpt.catalog.mirrors import MirrorRow
from casckpt.engine.versions import records
from casckpt.engine.versions.validate import check_name
from casckpt.errors import (
    AccessDeniedError,
    CasckptError,
    InvalidArgumentError,
    MirrorDestinationError,
    MirrorsFailedError,
    NotAStoreError,
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
from casckpt.mirror_sending import MirrorEnd, Sending, Slot
from casckpt.mirror_worker import MirrorWorker
from casckpt.storage import redact_url
from casckpt.store_core import StoreCore
from casckpt.types import ProgressCallback, Version

log = logging.getLogger(__name__)

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
        missing = missing_of(self._core.catalog, [("mirrors", "DELETE"), ("mirror_versions", "DELETE"),
                                                   ("mirror_tags", "DELETE")])
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
        recorded and the other mirrors still run.

        Returns:
            Every mirror's report, by name.

        Raises:
            MirrorsFailedError: a destination or more could not be opened (a
                MirrorDestinationError): it carries the reports of the mirrors that ran
                (``reports``) and each error (``errors``, by mirror name).
        """
        reports: builtins.list[MirrorReport] = []
        errors: dict[str, MirrorDestinationError] = {}
        for row in mirror_sql.mirrors(self._core.catalog):
            try:
                reports.append(self._run(row, dry_run, progress, None))
            except MirrorDestinationError as exc:
                errors[row.name] = exc
        if errors:
            raise MirrorsFailedError(reports, errors)
        return reports

    def _run(self, row: MirrorRow, dry_run: bool, progress: ProgressCallback | None,
             stopping: Callable[[], bool] | None) -> MirrorReport:
        """One run (see :meth:`push`); ``stopping``: a thread's stop flag (versions then go one by
        one, the flag read between them), None in the foreground. A run (not a dry run) holds
        the mirror's run lock: a second run of it, here or in another process, waits for the
        first, then finds its work done."""
        if not dry_run:
            self._core.refuse_write("a mirror run", "the catalog")
        rights = [("mirror_tags", "SELECT")] + ([] if dry_run else [("mirror_tags", "INSERT"),
                                                                   ("mirror_tags", "UPDATE")])
        missing = missing_of(self._core.catalog, rights)
        if missing:  # a role granted before migration 0019 still commits, but cannot run mirrors
            raise AccessDeniedError(
                f"a {'dry ' if dry_run else ''}run of mirror {row.name!r} needs {missing[0]} in the "
                "catalog, which these credentials lack (the table came with a casckpt upgrade after "
                "the role's grants were made); nothing was sent: have the tables' owner run the "
                "statements of `casckpt init --print-grants` for this role again", right=missing[0])
        if dry_run:
            return self._run_held(row, dry_run, progress, stopping)
        with mirror_lock(self._core.catalog, row.name):
            return self._run_held(row, dry_run, progress, stopping)

    def _run_held(self, row: MirrorRow, dry_run: bool, progress: ProgressCallback | None,
                  stopping: Callable[[], bool] | None) -> MirrorReport:
        started = time.monotonic()
        selection = selection_from_json(row.selection, row.name)
        chosen = self._chosen(row, selection)
        if not dry_run:
            mirror_sql.run_started(self._core.catalog, row.name, row.created_at)
            # a failure matters while its version is selected (a failed one is not at the
            # destination): one no longer selected (untagged, deleted here) leaves the status
            mirror_sql.unselect_failures(self._core.catalog, row.name, row.created_at,
                                         {v.id for v, _ in chosen})
        error: str | None = None
        try:
            dest = self._open(row, create=not dry_run)
            if dest is None:  # a dry run before the first: the destination is not made yet
                return MirrorReport(row.name, redact_url(row.destination), tuple(
                    MirroredVersion(v.id, "", v.run, v.step, "would send", 0, v.logical_bytes, reasons)
                    for v, reasons in chosen), 0, sum(v.logical_bytes for v, _ in chosen), (), True,
                    time.monotonic() - started)
            try:
                sending = Sending(self._core, row, self._source, dest, dry_run, progress, stopping)
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
                            dry_run, time.monotonic() - started, tuple(sorted(set(sending.stale_tags))))

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
                held = [Slot.of(o) for o in recorded if o.run == run.name and o.version_id not in visible]
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
        worker = MirrorWorker(row, float(interval), None if poll is None else float(poll),
                              run=self._background_run, latest=self._latest)
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

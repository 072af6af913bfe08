"""``store.ops``: operating a store -- integrity, drills, reports, audit, rebuilds, settings.

:class:`Ops` is the namespace of :class:`casckpt.Store` for what an operator runs beside
training: ``check`` and ``repair``, restore ``drill`` and its history, the interval
``advise``, the HTML ``report``, the ``audit`` trail, ``stats`` and ``gc_history``, the delta
chain setting, and the rebuilds (cache, catalog) and tree migration. The engines are
imported by the methods that run them, so opening a store for a query does not load them.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Iterable
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from casckpt.catalog import deltas as deltas_sql
from casckpt.catalog import drills as drills_sql
from casckpt.catalog import gc as gc_sql
from casckpt.catalog import inventory
from casckpt.catalog.settings import DELTA_CHAIN, DELTA_POLICY
from casckpt.engine.maintenance import advise as advisor
from casckpt.engine.maintenance import drill as drills
from casckpt.engine.maintenance.deleterights import require_delete_rights
from casckpt.engine.versions import records
from casckpt.engine.versions.logfilter import time_bound
from casckpt.engine.versions.refs import check_run
from casckpt.engine.versions.validate import check_limit, check_name
from casckpt.errors import InvalidArgumentError, VersionNotFound
from casckpt.jsonable import jsonable
from casckpt.store_core import StoreCore
from casckpt.types import (
    Advice,
    AuditEntry,
    CheckReport,
    DrillReport,
    DrillResult,
    GCRun,
    MigrationReport,
    ProgressCallback,
    RebuildReport,
    RepairReport,
    StoreStats,
)

if TYPE_CHECKING:
    from casckpt.report.data import ReportSource

Duration = float | int | timedelta | str
"""A duration for :meth:`Ops.advise`: seconds, a timedelta or text (``"8h"``)."""


class Ops:
    """Operating one open store (``store.ops``); thread-safe as the store is.

    ``source`` is the store itself, which :meth:`report` reads through its public queries.
    """

    def __init__(self, core: StoreCore, source: ReportSource) -> None:
        self._core, self._source = core, source

    # -- integrity --------------------------------------------------------------

    def check(self, *, read_data: bool = False, read_data_subset: float | str | None = None,
              progress: ProgressCallback | None = None) -> CheckReport:
        """Check the catalog against the blob locations.

        Args:
            read_data: read every pack in full: verify each shard and every chunk, and
                recompute the fingerprint of each tensor a commit reused on a change hint
                (a ``hint`` problem where the hint was wrong; a sample, see ``Store.commit``).
            read_data_subset: scrub only this share of the stored bytes (``"5%"``,
                ``0.05``), least recently verified packs first; a cron job running
                ``check --read-data-subset 5%`` daily verifies everything every 20 days.

        Damaged shards found are queued for :meth:`repair`. Data is never modified.
        """
        subset = parse_fraction(read_data_subset) if read_data_subset is not None else None
        from casckpt.engine.maintenance import check as check_engine

        return check_engine.check(self._core.ctx, read_data=read_data, progress=progress,
                                  read_data_subset=subset)

    def repair(self, *, progress: ProgressCallback | None = None) -> RepairReport:
        """Rebuild lost or corrupt shards and move shards off retiring or failed locations.

        Safe while other processes commit, restore and collect garbage.
        """
        self._core.refuse_write("store.ops.repair", "the catalog and the locations")
        self._core.refuse_while_recovering("repair")
        require_delete_rights(self._core.ctx, "repair", objects=False)  # the admin role's catalog rights
        from casckpt.engine.maintenance import repair as repair_engine

        report = repair_engine.repair(self._core.ctx, progress)
        self._core.catalog.record_audit("repair", None, _counts(report))
        return report

    # -- drills and advice ------------------------------------------------------

    def drill(self, runs: str | Iterable[str] | None = None, count: int = 3, seed: int | None = None,
              progress: ProgressCallback | None = None) -> DrillReport:
        """A restore drill: read versions back as a restart would, and record what happened.

        Picks the latest version of each run in ``runs`` (every run: None), then random older
        visible versions (``seed``: a repeatable choice) up to ``count`` in all, and restores
        each one into memory through the verified path ``Store.restore`` takes (every byte
        checked against its id; nothing written to disk), timing it. A version that does not
        restore -- damaged or missing data, a lost version, one not drained from a fast tier
        yet -- is a failed result with the error's message; the drill goes on to the next.

        The results go to the catalog's ``drills`` table in one transaction, with a ``drill``
        row in the audit trail (:meth:`drill_history` reads them); a read-only store drills
        and records nothing (``DrillReport.recorded`` False). Nothing else in the store
        changes: reads do not heal what they find (``casckpt repair`` does; a damaged shard
        of a pack with redundancy is marked for it, as ``check`` marks it).

        ``progress`` gets ``("drill", versions done, versions)`` and each restore's ``read``.
        Each version is held in memory whole while it is checked (one at a time).

        Raises:
            RunNotFoundError: a run in ``runs`` does not exist.
            VersionNotFound: a run in ``runs`` has no version to drill (a restart of it
                would have nothing to restore; nothing is recorded).
            InvalidArgumentError: ``count`` is not a positive int.
            CatalogError: the results could not be recorded.
        """
        count = drills.check_count(count)
        catalog = self._core.catalog
        names = None if runs is None else ([runs] if isinstance(runs, str) else list(dict.fromkeys(runs)))
        for name in names or ():
            check_run(catalog, name)
        chosen = drills.pick(drills_sql.visible_versions(catalog, names), count, random.Random(seed))
        for name in sorted(set(names or ()) - {row.run for row in chosen}):
            # a run asked for by name that has nothing a restart could restore is not "ok"
            raise VersionNotFound(name, "the run has no version to drill (none committed, or every one "
                                  "deleted; a version still on this host's fast tier is drilled once "
                                  "drained): a restart of it would have nothing to restore")
        record = self._core.read_only is None
        drill_id, results = drills.drill(self._core.ctx, chosen, record=record, progress=progress)
        return DrillReport(drill_id, results, recorded=record)

    def drill_history(self, limit: int | None = 100, run: str | None = None) -> list[DrillResult]:
        """Past drills' results, newest first: at most ``limit`` (None: all), of ``run`` only
        when given.

        Raises:
            InvalidArgumentError: ``limit`` is not None or an int from 1 to 2**63 - 1.
        """
        return drills_sql.history(self._core.catalog, limit=check_limit(limit, minimum=1), run=run)

    def advise(self, run: str, *, mtbf: Duration, restart: Duration = 0.0) -> Advice:
        """The checkpoint interval that minimises the time ``run`` loses to checkpoints and
        failures (Young 1974, Daly 2006; :mod:`casckpt.engine.maintenance.advise` has the formulas and
        their assumptions), from what the run measured: the median stall of its last 20
        commits (``Version.stall_s``), the median time of its successful drills (or, with
        none, one restore of its latest version measured now, unrecorded), plus ``restart``.

        Args:
            run: the run.
            mtbf: mean time between failures of the job: seconds, a timedelta or text
                (``"8h"``), from 1 s to 100 years.
            restart: time to get the job running again before the restore (``"5m"``), from 0
                to 100 years.

        Raises:
            RunNotFoundError: no such run.
            InvalidArgumentError: ``mtbf`` or ``restart`` not a duration or out of its range
                (``casckpt advise`` refuses the same text the same way), or the run has fewer
                than 2 commits with a recorded stall.
            IntegrityError, VersionLostError, ...: the restore measured failed (the run's
                latest version does not restore: see ``casckpt drill``).
        """
        mtbf_s = advisor.seconds(mtbf, "mtbf", allowed=advisor.MTBF_RANGE_S)
        restart_s = advisor.seconds(restart, "restart", allowed=advisor.RESTART_RANGE_S)
        catalog = self._core.catalog
        check_run(catalog, run)
        commits = drills_sql.recent_commits(catalog, run, advisor.HISTORY)
        advisor.check_history(run, commits)  # before a restore is measured for nothing
        drilled = [r.seconds for r in drills_sql.history(catalog, limit=advisor.HISTORY, run=run) if r.ok]
        if drilled:
            restore_s, source = statistics.median(drilled), "drills"
        else:
            restore_s, source = self._measure_restore(run), "measured"
        return advisor.advise(run, commits, restore_s=restore_s, restore_source=source,
                              restart_s=restart_s, mtbf_s=mtbf_s)

    def _measure_restore(self, run: str) -> float:
        """Seconds to restore ``run``'s latest version into memory (as a drill does, unrecorded);
        raises what the restore raises: a run whose latest version cannot be restored gets no
        advice."""
        row = self._core.catalog.nth_latest(run, 0)
        if row is None:
            raise InvalidArgumentError(f"run {run!r} has no visible version to measure a restore with")
        read_back = drills.reader(self._core.ctx)
        started = time.monotonic()
        read_back(row)
        return time.monotonic() - started

    # -- what happened ----------------------------------------------------------

    def report(self, path: str | os.PathLike[str], runs: Iterable[str] | None = None) -> Path:
        """Write a self-contained HTML report of the store to ``path`` and return it.

        Plots (inline SVG, light and dark mode, each with its data as a table): space saved
        by dedup and delta coding, new bytes per commit, metric curves with tagged and best
        versions marked, the lineage of runs and forks, storage by run, versions by
        durability, commit stalls, gc history, location health (probed now) and restore
        drills. ``runs`` limits the per-run plots to those runs (default: every run).
        Read-only: a read-only store can report. Needs the ``report`` extra (matplotlib).

        Raises:
            OptionalDependencyError: matplotlib is not installed (``pip install 'casckpt[report]'``).
            RefNotFoundError: a run in ``runs`` does not exist.
            InvalidArgumentError: ``runs`` is not a list of run names, or ``path`` exists and is
                not a file (a folder, a pipe: never replaced).
        """
        from casckpt.report import write_report  # matplotlib: only when a report is asked for

        chosen = None if runs is None else ([runs] if isinstance(runs, str) else list(runs))
        root = self._core.root
        title = f"casckpt store {root}" if root is not None else "casckpt store"
        return write_report(self._source, path, chosen, title=title)

    def audit(self, *, since: datetime | float | None = None, until: datetime | float | None = None,
              action: str | None = None, target: str | None = None,
              limit: int | None = None) -> list[AuditEntry]:
        """The store's audit trail: who changed what, and when, oldest first.

        Every commit, delete and undelete, tag, run created or forked, gc that changed
        anything (not dry runs), retention policy change, location change, repair, catalog
        rebuild and schema migration leaves one row, written in the transaction that made the
        change (see :class:`~casckpt.types.AuditEntry` and docs/guides/audit.md). gc never
        deletes rows.

        Args:
            since: the inclusive lower time bound (datetime, naive = local time, or epoch seconds).
            until: the inclusive upper time bound (as ``since``).
            action: an action (``"commit"``), or a family (``"location"``: every ``location.*``).
            target: a version id (or a prefix of 4+ hex digits), ``run:NAME``, ``tag:NAME``,
                ``location:NAME``.
            limit: only the newest ``limit`` rows (still oldest first).

        Raises:
            InvalidArgumentError: a bad bound, filter or limit.
        """
        limit = check_limit(limit)
        for name, value in (("action", action), ("target", target)):
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidArgumentError(f"{name} must be a non-empty str, got {value!r}")
        return self._core.catalog.audit_entries(
            since=time_bound(since, "since", upper=False), until=time_bound(until, "until", upper=True),
            action=action, target=target, limit=limit)

    def stats(self) -> StoreStats:
        """Space accounting: logical vs unique vs stored bytes, and what delta coding saved."""
        catalog = self._core.catalog
        deltas = deltas_sql.delta_totals(catalog)
        return StoreStats(
            **inventory.totals(catalog), redundancy=str(self._core.ctx.packs.placement.redundancy_for(None)),
            delta_chunks=deltas.chunks, delta_raw_bytes=deltas.raw_bytes,
            delta_stored_bytes=deltas.stored_bytes, longest_chain=deltas.longest_chain,
            mean_chain=deltas.mean_chain, delta_chain=deltas_sql.store_delta_chain(catalog),
            run_delta_chains=DELTA_CHAIN.runs(catalog))

    def gc_history(self, *, since: datetime | float | None = None) -> list[GCRun]:
        """The gc runs (not dry runs) started since ``since`` (a datetime or epoch seconds;
        None: all), oldest first, each with what it committed to the catalog.

        A run's counts are written in the transactions that delete what they count, so a run
        killed with -9 or failing is counted too -- unlike the ``gc --json`` lines, which such
        a run never prints. Sum these for the true totals over a day of cron runs.
        """
        when = since.timestamp() if isinstance(since, datetime) else since
        return gc_sql.runs_since(self._core.catalog, when)

    # -- delta coding -----------------------------------------------------------

    def delta_chain(self, run: str | None = None) -> int:
        """Deltas deep a chunk may be stored before a keyframe (0: no delta coding): the
        store's, or what commits to ``run`` use (its own, else the store's)."""
        if run is None:
            return deltas_sql.store_delta_chain(self._core.catalog)
        return deltas_sql.delta_policy_for(self._core.catalog, check_name(run, "run"))[0]

    def delta_policy(self, run: str | None = None) -> str:
        """The delta policy, ``off``, ``balanced`` (the default) or ``max``: the store's, or what
        commits to ``run`` use (its own, else the store's)."""
        named = None if run is None else check_name(run, "run")
        return deltas_sql.delta_policy_name(self._core.catalog, named)

    def set_delta_policy(self, policy: str | None, *, run: str | None = None) -> None:
        """Set how far commits may trade restore time for space with deltas, for the whole store
        or (``run``) one run; ``run`` with ``policy=None`` follows the store again.

        - ``off``: no deltas; each chunk is stored plain (byte planes or zstd where that pays),
          so any version restores at the cost of a keyframe.
        - ``balanced`` (default): deltas where they pay within a chain whose estimated restore
          cost stays within 1.2x a keyframe's: sparse deltas (rows of an embedding, a partial
          update) and small dense ones; never on optimizer moments.
        - ``max``: dense deltas wherever they are clearly smaller than the plain encoding, in
          chains whose estimated restore stays within 2x a keyframe's.

        A chain length set with :meth:`set_delta_chain` overrides the bound with a fixed depth.
        The bounds are of the cost model's estimate, which counts the data work of each level
        (decompress, XOR); a chain of many sparse levels also pays a catalog lookup and a read
        per level, which the estimate leaves out (docs/DEFAULTS.md has measured restores).

        Raises:
            InvalidArgumentError: ``policy`` is not one of those names.
        """
        self._core.refuse_write("store.ops.set_delta_policy", "the catalog")
        core = self._core
        if policy not in deltas_sql.DELTA_POLICIES and not (policy is None and run is not None):
            raise InvalidArgumentError(
                f"delta policy must be one of {', '.join(deltas_sql.DELTA_POLICIES)} (or None with "
                f"run= to make a run follow the store); got {policy!r}")
        if run is None and policy is not None:
            DELTA_POLICY.set_store(core.catalog, policy)
            records.record_store(core.locations, core.catalog)
        elif run is not None:
            DELTA_POLICY.set_run(core.catalog, check_name(run, "run"), policy)
            records.record_run(core.locations, core.catalog, run)

    def set_delta_chain(self, chain: int, *, run: str | None = None) -> None:
        """Set how many deltas deep a chunk may be stored before a keyframe (0: no delta coding),
        for the whole store or (``run``) one run; ``run`` with ``chain=-1`` follows the store again.

        Longer chains store less (a chunk that changes a little each commit costs only its
        delta) but restoring the end of a chain decodes every delta down from its keyframe.

        Raises:
            InvalidArgumentError: ``chain`` is out of range.
        """
        self._core.refuse_write("store.ops.set_delta_chain", "the catalog")
        if (isinstance(chain, bool) or not isinstance(chain, int) or not -1 <= chain <= 64
                or (chain == -1 and run is None)):
            raise InvalidArgumentError(
                "delta chain length must be 0 (off) to 64, or -1 to make a run follow the store; "
                f"got {chain!r}")
        core = self._core
        if run is None:
            DELTA_CHAIN.set_store(core.catalog, chain)
            records.record_store(core.locations, core.catalog)
        else:
            own = None if chain < 0 else chain
            DELTA_CHAIN.set_run(core.catalog, check_name(run, "run"), own)
            records.record_run(core.locations, core.catalog, run)

    # -- rebuilds and migration -------------------------------------------------

    def rebuild_cache(self) -> int:
        """Drop and refill this host's index cache from the catalog; returns the chunks cached."""
        self._core.refuse_write("store.ops.rebuild_cache", "this host's index cache")
        from casckpt.engine.maintenance import rebuild as rebuild_engine

        return rebuild_engine.refill_cache(self._core.ctx)

    def rebuild_catalog(self, *, progress: ProgressCallback | None = None) -> RebuildReport:
        """Recreate an empty catalog from the blob locations alone
        (see :mod:`casckpt.engine.maintenance.rebuild`).

        Raises:
            InvalidArgumentError: the catalog is not empty.
        """
        self._core.refuse_write("store.ops.rebuild_catalog", "the catalog and the locations")
        from casckpt.engine.maintenance import rebuild as rebuild_engine

        report = rebuild_engine.rebuild(self._core.ctx, progress)
        self._core.catalog.record_audit("catalog.rebuild", None, _counts(report))
        self._core.recovering = False
        self._core.reload_locations({})  # the states the locations record restored
        return report

    def migrate_trees(self, *, progress: ProgressCallback | None = None) -> MigrationReport:
        """Give every version of manifest format 1 (written before tree manifests) its tree, so
        queries read it as a tree and its ``tensors`` rows go (see
        :mod:`casckpt.engine.maintenance.treemigrate`). Version ids and restores do not change.

        Resumable and idempotent (run it again after an interruption; a second run does
        nothing); safe while other processes commit, restore and run gc. ``open`` never runs
        it: on a large store it takes a while.

        Raises:
            CatalogError: nodes kept disappearing under a gc with grace 0; run it again.
            StorageError: nodes could not be written (the batches done so far stay done).
        """
        self._core.refuse_write("store.ops.migrate_trees", "the catalog and the locations")
        require_delete_rights(self._core.ctx, "migrate-trees", objects=False)  # deletes tensors rows
        from casckpt.engine.maintenance import treemigrate as treemigrate_engine  # the commit engine: torch

        report = treemigrate_engine.migrate(self._core.ctx, progress)
        if report.versions_migrated or report.nodes_written or report.tensor_rows_deleted:
            self._core.catalog.record_audit("trees.migrate", None, _counts(report))
        return report


def parse_fraction(value: float | str) -> float:
    """``0.05``, ``"5%"`` or ``"0.05"`` -> 0.05.

    Raises:
        InvalidArgumentError: not a fraction in (0, 1].
    """
    text = str(value).strip()
    try:
        fraction = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise InvalidArgumentError(f"{value!r} is not a share of the store: use e.g. 5% or 0.05") from None
    if not 0 < fraction <= 1:
        raise InvalidArgumentError(f"{value!r} must be more than 0% and at most 100%")
    return fraction


def _counts(report: object) -> dict[str, object]:
    """A report as an audit row's detail: its numbers, and how many items each list holds
    (the pack ids and reasons themselves stay in the report and the log)."""
    return {k: len(v) if isinstance(v, (list, tuple)) else v
            for k, v in jsonable(report).items()}

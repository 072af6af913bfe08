"""StoreDrills: restore drills and the checkpoint-interval advisor of a :class:`casckpt.Store`.

A part of the facade like :class:`~casckpt.store_admin.StoreAdmin`: it takes the
:class:`~casckpt.store_core.StoreCore` and reaches into no other part. The drill itself is
:mod:`casckpt.engine.drill`, the advice :mod:`casckpt.engine.advise`, their SQL
:mod:`casckpt.catalog.drills`.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Iterable
from datetime import timedelta

from casckpt.catalog import drills as sql
from casckpt.engine import advise as advisor
from casckpt.engine import drill as drills
from casckpt.engine.refs import check_run
from casckpt.engine.validate import check_limit
from casckpt.errors import InvalidArgumentError, VersionNotFound
from casckpt.store_core import StoreCore
from casckpt.types import Advice, DrillReport, DrillResult, ProgressCallback

Duration = float | int | timedelta | str


class StoreDrills:
    """Restore drills, their history, and interval advice over one store's core."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    def drill(self, runs: str | Iterable[str] | None, count: int, seed: int | None,
              progress: ProgressCallback | None) -> DrillReport:
        """See :meth:`casckpt.Store.drill`."""
        count = drills.check_count(count)
        catalog = self._core.ctx.catalog
        names = None if runs is None else ([runs] if isinstance(runs, str) else list(dict.fromkeys(runs)))
        for name in names or ():
            check_run(catalog, name)
        chosen = drills.pick(sql.visible_versions(catalog, names), count, random.Random(seed))
        for name in sorted(set(names or ()) - {row.run for row in chosen}):
            # a run asked for by name that has nothing a restart could restore is not "ok"
            raise VersionNotFound(name, "the run has no version to drill (none committed, or every one "
                                  "deleted; a version still on this host's fast tier is drilled once "
                                  "drained): a restart of it would have nothing to restore")
        record = self._core.read_only is None
        drill_id, results = drills.drill(self._core.ctx, chosen, record=record, progress=progress)
        return DrillReport(drill_id, results, recorded=record)

    def drill_history(self, limit: int | None, run: str | None) -> list[DrillResult]:
        """See :meth:`casckpt.Store.drill_history`."""
        return sql.history(self._core.ctx.catalog, limit=check_limit(limit, minimum=1), run=run)

    def advise(self, run: str, mtbf: Duration, restart: Duration) -> Advice:
        """See :meth:`casckpt.Store.advise`."""
        mtbf_s = advisor.seconds(mtbf, "mtbf", allowed=advisor.MTBF_RANGE_S)
        restart_s = advisor.seconds(restart, "restart", allowed=advisor.RESTART_RANGE_S)
        catalog = self._core.ctx.catalog
        check_run(catalog, run)
        commits = sql.recent_commits(catalog, run, advisor.HISTORY)
        advisor.check_history(run, commits)  # before a restore is measured for nothing
        drilled = [r.seconds for r in sql.history(catalog, limit=advisor.HISTORY, run=run) if r.ok]
        if drilled:
            restore_s, source = statistics.median(drilled), "drills"
        else:
            restore_s, source = self._measure_restore(run), "measured"
        return advisor.advise(run, commits, restore_s=restore_s, restore_source=source,
                              restart_s=restart_s, mtbf_s=mtbf_s)

    def _measure_restore(self, run: str) -> float:
        """Seconds to restore ``run``'s latest version into memory (as a drill does, unrecorded).

        Raises:
            What :func:`casckpt.engine.drill.reader`'s function raises: a run whose latest
            version cannot be restored gets no advice.
        """
        row = self._core.ctx.catalog.nth_latest(run, 0)
        if row is None:
            raise InvalidArgumentError(f"run {run!r} has no visible version to measure a restore with")
        read_back = drills.reader(self._core.ctx)
        started = time.monotonic()
        read_back(row)
        return time.monotonic() - started

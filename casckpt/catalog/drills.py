"""The SQL side of restore drills and of the interval advisor (see :mod:`casckpt.engine.maintenance.drill`,
:mod:`casckpt.engine.maintenance.advise`).

A drill's results are written in ONE transaction, with the ``drill`` row of the audit
trail: a drill is in the history whole or not at all. Rows are only ever added (gc keeps
them, like the audit trail; a few hundred bytes per version drilled).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from sqlalchemy import select

from casckpt.catalog import schema as s
from casckpt.catalog.catalog import Catalog, idempotent
from casckpt.catalog.rows import VersionRow, version_query, version_row
from casckpt.types import DrillResult

_FAILED_LISTED = 100  # failed versions the audit row names (the drills table has them all)


class Commit(NamedTuple):
    """One commit of a run, as the advisor sees it."""

    step: int
    created_at: float
    stall_s: float


@idempotent
def visible_versions(catalog: Catalog, runs: Sequence[str] | None) -> list[VersionRow]:
    """The visible versions of ``runs`` (every run: None), by run name then step."""
    query = version_query()
    if runs is not None:
        query = query.where(s.runs.c.name.in_(list(runs)))
    query = query.order_by(s.runs.c.name, s.versions.c.step)
    with catalog.read() as conn:
        return [row for r in conn.execute(query) if (row := version_row(r)) is not None]


def add(catalog: Catalog, results: Sequence[DrillResult]) -> None:
    """Add one drill's results and its ``drill`` audit row, in one transaction.

    Raises:
        ReadOnlyStoreError: the catalog was opened read-only.
        CatalogError, CatalogUnavailableError: nothing was recorded.
    """
    if not results:
        return
    failed = [r.version_id for r in results if not r.ok]
    with catalog.write() as conn:
        conn.execute(s.drills.insert(), [
            {"drill_id": r.drill_id, "at": r.at, "version_id": r.version_id, "run": r.run,
             "step": r.step, "bytes": r.bytes, "seconds": r.seconds, "ok": r.ok, "error": r.error}
            for r in results])
        catalog.audit_in(conn, "drill", None, {
            "drill_id": results[0].drill_id, "versions": len(results), "failed": len(failed),
            "failed_versions": failed[:_FAILED_LISTED]})


@idempotent
def history(catalog: Catalog, *, limit: int | None, run: str | None) -> list[DrillResult]:
    """Drill results, newest first (at most ``limit``; of ``run`` only, when given)."""
    d = s.drills
    query = select(d.c.drill_id, d.c.at, d.c.version_id, d.c.run, d.c.step, d.c.bytes, d.c.seconds,
                   d.c.ok, d.c.error).order_by(d.c.at.desc(), d.c.id.desc())
    if run is not None:
        query = query.where(d.c.run == run)
    if limit is not None:
        query = query.limit(limit)
    with catalog.read() as conn:
        return [DrillResult(str(r[0]), float(r[1]), str(r[2]), str(r[3]), int(r[4]), int(r[5]),
                            float(r[6]), bool(r[7]), r[8]) for r in conn.execute(query)]


@idempotent
def recent_commits(catalog: Catalog, run: str, limit: int) -> list[Commit]:
    """The ``limit`` latest commits of ``run`` that recorded a stall, by step (oldest first).

    Soft-deleted versions count (they were committed then, and retention deleting every
    other one must not double the interval measured); purged ones are gone.
    """
    v = s.versions
    query = (select(v.c.step, v.c.created_at, v.c.stall_s)
             .join(s.runs, s.runs.c.id == v.c.run_id)
             .where(s.runs.c.name == run, v.c.stall_s.is_not(None))
             .order_by(v.c.step.desc()).limit(limit))
    with catalog.read() as conn:
        return [Commit(int(r[0]), float(r[1]), float(r[2])) for r in reversed(conn.execute(query).all())]

"""Retention in the catalog: policies per run, what retention looks at, soft delete and undelete.

A policy is the JSON in ``runs.retention`` (None: keep everything); this
module stores and returns it as JSON and leaves its meaning to
``casckpt.engine.maintenance.retention``. Soft delete sets ``versions.state`` to
``'deleted'`` with ``deleted_at`` / ``deleted_reason``; every query of the
catalog filters ``state = 'visible'``, so a deleted version leaves refs, log,
show and check at once. It stays undeletable until GC sweeps its chunks.

Functions taking a ``Connection`` run inside the caller's transaction, so GC
can load, plan and delete in ONE write transaction (``Catalog.write()``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Row, Select, null, or_, select

from casckpt.catalog import schema as s
from casckpt.catalog.catalog import Catalog
from casckpt.catalog.database import batches
from casckpt.catalog.publish import MissingChunksError, revive_or_missing
from casckpt.catalog.rows import VERSION_COLUMNS, grouped, version
from casckpt.errors import AmbiguousRefError, InvalidArgumentError, RefNotFoundError
from casckpt.types import Version

_HEX = re.compile(r"^[0-9a-f]{4,64}$")
_MAX_STEP = 1 << 63  # steps are 64-bit in the catalog


@dataclass(frozen=True, slots=True)
class RunHistory:
    """What retention needs to know about one run.

    Attributes:
        run: the run's name.
        policy: its stored policy JSON (None: keep everything).
        versions: its visible versions, newest (highest step) first, with tags.
        forks: version id -> names of the live runs forked from that version
            (see :func:`fork_points`; their fork points are always kept).
    """

    run: str
    policy: Mapping[str, Any] | None
    versions: tuple[Version, ...]
    forks: Mapping[str, tuple[str, ...]]


# -- policies ---------------------------------------------------------------------


def store_policy(catalog: Catalog, run: str, policy: Mapping[str, Any] | None, *, create: bool) -> bool:
    """Set (or with None, clear) the policy of ``run``.

    With ``create``, a run that does not exist yet is created (a training script
    may set its policy before the first commit). Returns False when the run
    does not exist and was not created.
    """
    with catalog.write() as conn:
        run_id = catalog.run_id(conn, run, create=create)
        if run_id is None:
            return False
        conn.execute(s.runs.update().where(s.runs.c.id == run_id)
                     .values(retention=null() if policy is None else dict(policy)))  # SQL NULL, not JSON null
        if policy is None:
            catalog.audit_in(conn, "retention.clear", f"run:{run}")
        else:
            catalog.audit_in(conn, "retention.set", f"run:{run}", {"policy": dict(policy)})
        return True


def run_policies(catalog: Catalog, run: str | None = None) -> dict[str, Any]:
    """Run name -> stored policy JSON (None when it has none).

    With ``run``: that run only (an empty dict when it does not exist); without:
    every run that has a policy, by name.
    """
    with catalog.read() as conn:
        return {name: policy for name, policy in conn.execute(_runs(run, s.runs.c.name, s.runs.c.retention))}


def _runs(run: str | None, *columns: Any) -> Select[Any]:
    """``columns`` of run ``run``, or (None) of every run that has a policy, by name."""
    query = select(*columns).order_by(s.runs.c.name)
    return query.where(s.runs.c.name == run if run is not None else s.runs.c.retention.is_not(None))


# -- what retention looks at --------------------------------------------------------


def fork_points(conn: Connection) -> dict[str, tuple[str, ...]]:
    """Version id -> names of the live runs forked from it.

    A run is live while it has visible versions, and also before its first
    commit (a fresh fork is about to restore its fork point); a run whose
    versions are all deleted no longer holds its fork point.
    """
    mine = s.versions.c.run_id == s.runs.c.id
    live = or_(
        select(s.versions.c.id).where(mine, s.versions.c.state == "visible").exists(),
        ~select(s.versions.c.id).where(mine).exists(),
    )
    rows = conn.execute(
        select(s.runs.c.parent_version, s.runs.c.name)
        .where(s.runs.c.parent_version.is_not(None), live).order_by(s.runs.c.name)
    )
    return grouped(rows)


def _tags(conn: Connection, run_ids: Sequence[int]) -> dict[str, tuple[str, ...]]:
    rows = conn.execute(
        select(s.tags.c.version_id, s.tags.c.name)
        .join(s.versions, s.versions.c.id == s.tags.c.version_id)
        .where(s.versions.c.run_id.in_(run_ids), s.versions.c.state == "visible")
        .order_by(s.tags.c.name)
    )
    return grouped(rows)


def load_histories(conn: Connection, run: str | None = None) -> list[RunHistory]:
    """The histories retention plans over, by run name.

    With ``run``: that run, with or without a policy (none if it does not
    exist); without: every run that has a policy.
    """
    runs = list(conn.execute(_runs(run, s.runs.c.id, s.runs.c.name, s.runs.c.retention)))
    if not runs:
        return []
    run_ids = [r.id for r in runs]
    rows = conn.execute(
        select(*VERSION_COLUMNS, s.versions.c.run_id)
        .join(s.runs, s.runs.c.id == s.versions.c.run_id)
        .where(s.versions.c.run_id.in_(run_ids), s.versions.c.state == "visible")
        .order_by(s.versions.c.step.desc())
    )
    tags = _tags(conn, run_ids)
    versions: dict[int, list[Version]] = {run_id: [] for run_id in run_ids}
    for row in rows:
        versions[row.run_id].append(version(row, tags.get(row.id, ())))
    forks = fork_points(conn)
    return [
        RunHistory(r.name, r.retention, tuple(versions[r.id]),
                   {v.id: forks[v.id] for v in versions[r.id] if v.id in forks})
        for r in runs
    ]


# -- soft delete and undelete ----------------------------------------------------------


def soft_delete(conn: Connection, version_ids: Iterable[str], reason: str,
                now: float | None = None) -> int:
    """Mark visible versions deleted; returns how many were (already deleted ones are skipped)."""
    when = time.time() if now is None else now
    count = 0
    for batch in batches(list(dict.fromkeys(version_ids))):
        result = conn.execute(
            s.versions.update()
            .where(s.versions.c.id.in_(batch), s.versions.c.state == "visible")
            .values(state="deleted", deleted_at=when, deleted_reason=reason)
        )
        count += result.rowcount
    return count


def delete_version(catalog: Catalog, version_id: str, reason: str) -> None:
    """Soft-delete one visible version (an explicit delete; fork points are not protected here).

    Raises:
        RefNotFoundError: it is no longer visible (deleted concurrently).
    """
    with catalog.write() as conn:
        if not soft_delete(conn, [version_id], reason):
            raise RefNotFoundError(version_id, "the version was deleted meanwhile")
        catalog.audit_in(conn, "delete", version_id, {**_run_step(conn, version_id), "reason": reason})


def _run_step(conn: Connection, version_id: str) -> dict[str, Any]:
    """The run and step of a version, for its audit row."""
    row = conn.execute(select(s.runs.c.name, s.versions.c.step)
                       .join(s.runs, s.runs.c.id == s.versions.c.run_id)
                       .where(s.versions.c.id == version_id)).one()
    return {"run": row[0], "step": row[1]}


def find_deleted(catalog: Catalog, *, prefix: str | None = None, run: str | None = None,
                 step: int | None = None, limit: int | None = 5) -> list[Row[Any]]:
    """Deleted versions by id prefix and/or run and step: id, run, step, deleted_at, deleted_reason."""
    query = (
        select(s.versions.c.id, s.runs.c.name.label("run"), s.versions.c.step,
               s.versions.c.deleted_at, s.versions.c.deleted_reason)
        .join(s.runs, s.runs.c.id == s.versions.c.run_id)
        .where(s.versions.c.state == "deleted").order_by(s.versions.c.id).limit(limit)
    )
    if prefix is not None:
        query = query.where(s.versions.c.id.startswith(prefix))
    if run is not None:
        query = query.where(s.runs.c.name == run)
    if step is not None:
        query = query.where(s.versions.c.step == step)
    with catalog.read() as conn:
        return list(conn.execute(query))


def undelete_version(catalog: Catalog, version_id: str, chunk_ids: Iterable[str]) -> bool:
    """Make a deleted version visible again, in ONE transaction that revives its chunks.

    Chunks GC has condemned but not swept are made live again, as a commit
    does; returns False when the version is no longer deleted (undeleted or
    purged meanwhile).

    Raises:
        MissingChunksError: GC already swept some of its chunks; nothing changed.
    """
    ids = list(dict.fromkeys(chunk_ids))
    with catalog.write() as conn:
        state = conn.execute(select(s.versions.c.state).where(s.versions.c.id == version_id)
                             .with_for_update()).scalar()
        if state != "deleted":
            return False
        missing = revive_or_missing(conn, ids)
        if missing:
            raise MissingChunksError(missing)
        conn.execute(s.versions.update().where(s.versions.c.id == version_id)
                     .values(state="visible", deleted_at=None, deleted_reason=None))
        catalog.audit_in(conn, "undelete", version_id, _run_step(conn, version_id))
        return True


def _not_deleted(ref: str, visible: bool, near: Sequence[str] = ()) -> RefNotFoundError:
    if visible:
        return RefNotFoundError(ref, "that version is not deleted")
    return RefNotFoundError(
        ref, "no deleted version matches (undelete takes a deleted version's id, a unique prefix "
        "of it, or run@step; GC purges deleted versions after its grace period)", near,
    )


def _deleted_at_step(catalog: Catalog, ref: str) -> Row[Any]:
    run, _, selector = ref.rpartition("@")
    if not selector.isdigit() or int(selector) >= _MAX_STEP:
        raise RefNotFoundError(ref, "undelete takes run@STEP with a step number, not latest or ~N")
    found = find_deleted(catalog, run=run, step=int(selector), limit=1)
    if not found:
        near = [f"{run}@{r.step}" for r in find_deleted(catalog, run=run, limit=3)]
        raise _not_deleted(ref, catalog.at_step(run, int(selector)) is not None, near)
    return found[0]


def resolve_deleted(catalog: Catalog, ref: str) -> Row[Any]:
    """The deleted version ``ref`` names: an exact id, a unique id prefix, or ``run@step``.

    Returns a row of id, run, step, deleted_at, deleted_reason.

    Raises:
        RefNotFoundError: no deleted version matches (the message says when
            the ref names a visible version).
        AmbiguousRefError: the prefix matches several deleted versions.
        InvalidArgumentError: ``ref`` is not a non-empty str.
    """
    if not isinstance(ref, str) or not ref:
        raise InvalidArgumentError(f"a ref must be a non-empty str, got {ref!r}")
    if "@" in ref:
        return _deleted_at_step(catalog, ref)
    if not _HEX.match(ref):
        raise _not_deleted(ref, False)
    found = find_deleted(catalog, prefix=ref)
    if len(found) > 1:
        raise AmbiguousRefError(
            f"{ref!r} matches several deleted versions ({', '.join(r.id[:12] for r in found)}); "
            "give more digits"
        )
    if not found:
        raise _not_deleted(ref, bool(catalog.ids_with_prefix(ref, 1)))
    return found[0]

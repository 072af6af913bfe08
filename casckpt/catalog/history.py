"""The SQL of history and lineage: filtered logs, tensor histories, contents, forks, the run lineage.

Everything is served from catalog tables (``versions``, ``tensors``,
``contents``, ``runs``, ``tags``); no manifest is read from the blob store.
Metric and metadata predicates are evaluated by the database through
SQLAlchemy's JSON element access, guarded by the JSON type of the element so
SQLite and PostgreSQL give the same answers (a string never compares as a
number, a version lacking the key never matches).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from sqlalchemy import ColumnElement, Connection, Select, Text, case, cast, func, select

from casckpt import collector
from casckpt.catalog import schema as s
from casckpt.catalog import treechanges
from casckpt.catalog.catalog import Catalog
from casckpt.catalog.database import BATCH, batches, upsert
from casckpt.catalog.rows import (
    VERSION_COLUMNS,
    StoredContent,
    content_row,
    tags_of,
    version_query,
    versions,
)
from casckpt.errors import RefNotFoundError, RunExistsError
from casckpt.types import Version

COMPARISONS: dict[str, Callable[[Any, Any], ColumnElement[bool]]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
    "==": operator.eq, "!=": operator.ne,
}

# JSON type names of each kind of value, per dialect (SQLite json_type, PostgreSQL json_typeof)
_JSON_TYPES: dict[str, dict[str, tuple[str, ...]]] = {
    "sqlite": {"number": ("integer", "real"), "string": ("text",), "bool": ("true", "false")},
    "postgresql": {"number": ("number",), "string": ("string",), "bool": ("boolean",)},
}


@dataclass(frozen=True, slots=True)
class Predicate:
    """``field[key] op value``: ``field`` is ``"metrics"`` or ``"meta"``; ``key`` a JSON path."""

    field: str
    key: tuple[str, ...]
    op: str
    value: float | bool | str


@dataclass(frozen=True, slots=True)
class LogFilter:
    """What ``log`` returns: every condition must hold. Times are epoch seconds, bounds inclusive."""

    run: str | None = None
    since: float | None = None
    until: float | None = None
    min_step: int | None = None
    max_step: int | None = None
    tag: str | None = None
    where: tuple[Predicate, ...] = ()
    ascending: bool = False
    limit: int | None = None


@dataclass(frozen=True, slots=True)
class Segment:
    """Part of a run's lineage: the visible versions of ``run`` up to ``max_step`` (None: all)."""

    run_id: int
    run: str
    max_step: int | None


def _json_type(column: Any, key: tuple[str, ...], dialect: str) -> ColumnElement[Any]:
    if dialect == "postgresql":
        return func.json_typeof(column[key])
    return func.json_type(column, "$." + ".".join(f'"{k}"' for k in key))


def predicate_clause(p: Predicate, dialect: str) -> ColumnElement[bool]:
    """The SQL condition of one predicate; NULL (so no match) where the key is absent."""
    compare = COMPARISONS[p.op]
    if p.field == "metrics":
        return compare(s.versions.c.metrics[p.key[0]].as_float(), p.value)
    column = s.versions.c.meta
    kinds = _JSON_TYPES["postgresql" if dialect == "postgresql" else "sqlite"]
    kind = _json_type(column, p.key, dialect)
    if isinstance(p.value, bool):
        text = "true" if p.value else "false"
        if dialect == "postgresql":
            return compare(case((kind.in_(kinds["bool"]), column[p.key].as_string())), text)
        return compare(case((kind.in_(kinds["bool"]), kind)), text)
    if isinstance(p.value, str):
        return compare(case((kind.in_(kinds["string"]), column[p.key].as_string())), p.value)
    return compare(case((kind.in_(kinds["number"]), column[p.key].as_float())), p.value)


def _log_query(f: LogFilter, dialect: str) -> Select[Any]:
    v = s.versions.c
    query = version_query()
    conditions: list[ColumnElement[bool]] = []
    if f.run is not None:
        conditions.append(s.runs.c.name == f.run)
    if f.since is not None:
        conditions.append(v.created_at >= f.since)
    if f.until is not None:
        conditions.append(v.created_at <= f.until)
    if f.min_step is not None:
        conditions.append(v.step >= f.min_step)
    if f.max_step is not None:
        conditions.append(v.step <= f.max_step)
    if f.tag is not None:
        conditions.append(v.id.in_(select(s.tags.c.version_id).where(s.tags.c.name == f.tag)))
    conditions += [predicate_clause(p, dialect) for p in f.where]
    order = (v.step, v.id) if f.run is not None else (v.created_at, v.id)
    query = query.where(*conditions).order_by(
        *(c.asc() if f.ascending else c.desc() for c in order)
    )
    return query.limit(f.limit) if f.limit is not None else query


def log(catalog: Catalog, f: LogFilter) -> list[Version]:
    """Visible versions matching ``f`` (by step within a run, else by time), with their tags.

    One read transaction, two statements whatever the number of versions.
    """
    with catalog.read() as conn, collector.paused():  # paused once connected, not while waiting
        rows = list(conn.execute(_log_query(f, conn.dialect.name)).all())
        tags = tags_of(conn, [r[0] for r in rows])
        return versions(rows, tags)


def tags(catalog: Catalog, run: str | None) -> list[tuple[str, float, Version]]:
    """Every tag pointing at a visible version (of run ``run`` only, when given), by name:
    (name, when it was set, the version). One read transaction, two statements."""
    query = (version_query().add_columns(s.tags.c.name, s.tags.c.created_at)
             .join(s.tags, s.tags.c.version_id == s.versions.c.id).order_by(s.tags.c.name))
    if run is not None:
        query = query.where(s.runs.c.name == run)
    with catalog.read() as conn:
        rows = list(conn.execute(query).all())
        found = versions(rows, tags_of(conn, list({r[0] for r in rows})))
    return [(r[-2], float(r[-1]), v) for r, v in zip(rows, found, strict=True)]


# -- tensor history ---------------------------------------------------------------------


def lineage(catalog: Catalog, run: str) -> list[Segment] | None:
    """The segments of ``run``'s ancestry, oldest first, ending with ``run`` itself.

    A forked run continues its parent run up to the fork point, and so on up
    the tree. None when there is no run named ``run``.
    """
    segments: list[Segment] = []
    with catalog.read() as conn:
        row = conn.execute(select(s.runs.c.id, s.runs.c.parent_version)
                           .where(s.runs.c.name == run)).first()
        if row is None:
            return None
        segments.append(Segment(row.id, run, None))
        parent, seen = row.parent_version, {row.id}
        while parent is not None:
            fork = conn.execute(
                select(s.versions.c.step, s.runs.c.id, s.runs.c.name, s.runs.c.parent_version)
                .join(s.runs, s.runs.c.id == s.versions.c.run_id).where(s.versions.c.id == parent)
            ).first()
            if fork is None or fork.id in seen:
                break
            seen.add(fork.id)
            segments.append(Segment(fork.id, fork.name, fork.step))
            parent = fork.parent_version
    return segments[::-1]


Stale = list[tuple[str, str | None]]
"""Tree versions without ``tree_changes`` rows against the version listed before them: (id, that one)."""


def tensor_changes(catalog: Catalog, segments: Sequence[Segment], path: str,
                   overlay: Mapping[str, tuple[str | None, tuple[Any, ...] | None]] | None = None,
                   ) -> tuple[list[tuple[Any, ...]], dict[str, tuple[str, ...]], Stale]:
    """Versions of the lineage where the tensor at ``path`` may have changed, ascending; their tags.

    The first visible version of each segment is kept, then those whose tensor
    digest at ``path`` differs from the version before. A tree version is read from
    ``tree_changes`` (:mod:`casckpt.catalog.treechanges`) where its rows are recorded
    against the version listed before it: kept where it has a row for ``path``, else
    unchanged; ``overlay`` adds such rows (version id -> (base id, state or None))
    that are not recorded. The third value lists the tree versions with no such rows,
    ``(id, the version listed before it)``: their answer is not in the rows returned,
    and the caller indexes them (:mod:`casckpt.engine.read.treeindex`) and asks again.
    Between two kept versions the tensor is unchanged, so each row's predecessor state
    is the previous row's. Each row holds :data:`VERSION_COLUMNS`, ``tree_root`` (NULL),
    then ``dtype, shape`` (JSON text), ``nbytes, digest`` of the tensor (NULL where
    the version has none), ``n`` (1 for the segment's first version), ``chunk_size,
    content_nbytes, chunk_ids`` from its ``contents`` row, and ``changed``: the
    changed bytes against the previous row where recorded (``tensors.changed_bytes``
    against its version's parent, whose tensor is the previous row's: same dtype,
    shape and digest; ``tree_changes.changed_bytes``), else NULL. The ``contents``
    columns are read only where a row's or the next row's ``changed`` is NULL;
    elsewhere they are NULL.

    One read transaction, ranges of covering indexes joined here: the tensor's
    rows in every version of the store (``ix_tensors_history``, ``tree_changes``),
    then each segment's visible versions in step order (``ix_versions_history``) --
    with all their columns when the tensor has many distinct contents (it changes
    often), else only their ids, and the kept versions' columns by key -- and the
    ``contents`` rows needed, by key.
    """
    t = s.tensors.c
    with catalog.read() as conn:
        states = {row[0]: row[1:] for row in conn.execute(
            select(t.version_id, t.dtype, cast(t.shape, Text), t.nbytes, t.digest, t.changed_bytes)
            .where(t.path == path))}
        keys = treechanges.indexed_of(conn, {seg.run_id for seg in segments})
        index = _Index(treechanges.states(conn, path, keys), dict(keys.values()))
        for version_id, (base, state) in (overlay or {}).items():
            index.base[version_id] = base
            if state is not None:
                index.rows[version_id] = state
        many = len({state[3] for state in states.values()} | {st[3] for st in index.rows.values()}) > BATCH
        kept = [k for seg in segments for k in _changed_states(conn, seg, states, many, index)]
        if not many:
            columns = _version_columns(conn, [k[0][0] for k in kept])
            kept = [(columns[r[0]][:-1] + (r[-1],), n, state) for r, n, state in kept if r[0] in columns]
        rows, needed = _rows(kept, states, index.used)
        found = _contents_in(conn, {rows[i][_DIGEST] for i in needed})
        tags = tags_of(conn, [r[0] for r in rows])
    for i in needed:
        row = rows[i]
        if (content := found.get(row[_DIGEST])) is not None:
            rows[i] = (*row[:_SIZE], *content, row[_CHANGED])
    return rows, tags, index.stale


_ROOT = len(VERSION_COLUMNS)
_DIGEST, _SIZE, _CHANGED = _ROOT + 4, _ROOT + 6, _ROOT + 9


def _segment_conditions(seg: Segment) -> list[ColumnElement[bool]]:
    v = s.versions.c
    conditions = [v.run_id == seg.run_id, v.state == "visible"]
    if seg.max_step is not None:
        conditions.append(v.step <= seg.max_step)
    return conditions


_ABSENT = (None, None, None, None, None)


@dataclass(slots=True)
class _Index:
    """The ``tree_changes`` rows of one path by version id, the versions with recorded rows,
    the versions whose state came from them, and the version listed last (across segments)
    with the tensor's digest in it (None: it had none; :data:`_UNKNOWN`: not known here).

    Both carry across segments: a fork's first version is recorded against the fork point,
    listed last in the segment before, so a path without a row there holds the fork point's
    tensor (or none), and a removal row in a later version is a change against that."""

    rows: dict[str, tuple[Any, ...]]
    base: dict[str, str | None]
    used: set[str] = field(default_factory=set)
    last: Any = None
    previous: Any = None
    stale: Stale = field(default_factory=list)


_UNKNOWN = object()
"""The tensor's digest in the version listed before, where it is not known (a tree version
without rows, or one read from ``tensors``' rows of a tree version)."""


def _changed_states(conn: Connection, seg: Segment, states: dict[str, tuple[Any, ...]],
                    columns: bool, index: _Index) -> list[tuple[Any, int, tuple[Any, ...]]]:
    """``(version, n, state)`` of the segment's versions where the tensor may have changed (see
    :func:`tensor_changes`), by step: ``version`` its :data:`VERSION_COLUMNS` and ``tree_root``
    when ``columns``, else only its id and ``tree_root`` (NULL where its state came from
    ``index``; a tree version without rows against the version before it is listed in
    ``index.stale`` instead); ``state`` the tensor's ``(dtype, shape, nbytes, digest,
    changed_bytes)`` in it, from ``states`` or ``index`` (by version id)."""
    v = s.versions.c
    query = version_query().add_columns(v.tree_root) if columns else select(v.id, v.tree_root)
    out: list[tuple[Any, int, tuple[Any, ...]]] = []
    previous = index.previous
    absent, get, base, recorded, used = _ABSENT, states.get, index.base, index.rows, index.used
    unknown = _UNKNOWN
    missing = object()
    for n, row in enumerate(conn.execute(query.where(*_segment_conditions(seg)).order_by(v.step)), 1):
        vid, last = row[0], index.last
        index.last = vid
        if row[-1] is not None:
            if base.get(vid, missing) != last:
                index.stale.append((vid, last))
                previous = unknown
                continue
            state = recorded.get(vid)
            if state is None:  # the parent's tensor, unchanged
                continue
            used.add(vid)
            if n == 1 or state[3] != previous or previous is unknown:
                out.append(((*row[:-1], None), n, state))
            previous = state[3]
            continue
        state = get(vid, absent)
        if n == 1 or state[3] != previous or row[-1] is not None:
            out.append((row, n, state))
        previous = state[3] if row[-1] is None else unknown
    index.previous = previous
    return out


def _version_columns(conn: Connection, ids: Sequence[str]) -> dict[str, Any]:
    """:data:`VERSION_COLUMNS` and ``tree_root`` of the visible versions among ``ids``, by id."""
    query = version_query().add_columns(s.versions.c.tree_root)
    return {r[0]: r for batch in batches(ids) for r in conn.execute(query.where(s.versions.c.id.in_(batch)))}


def _rows(kept: Sequence[tuple[Any, int, tuple[Any, ...]]], states: Mapping[str, tuple[Any, ...]],
          indexed: Collection[str]) -> tuple[list[tuple[Any, ...]], list[int]]:
    """The rows of :func:`tensor_changes` (``contents`` columns NULL), and the positions of
    those whose ``contents`` columns are needed (``indexed``: the versions whose state is a
    ``tree_changes`` row, against the previous row's)."""
    rows: list[tuple[Any, ...]] = []
    needed: list[int] = []
    before: tuple[Any, ...] | None = None  # the previous row's (dtype, shape, digest); None: a tree's
    get = states.get
    for version, n, (dtype, shape, nbytes, digest, stored) in kept:
        changed = None
        if version[0] in indexed:  # recorded against the parent: the previous row's tensor
            rows.append((*version, dtype, shape, nbytes, digest, n, None, None, None, stored))
            before = None
            continue
        if stored is not None and before is not None:
            parent = get(version[3])
            if parent is not None and (parent[0], parent[1], parent[3]) == before:
                changed = stored
        root = version[-1]
        if changed is None:  # compared from chunk lists: this row's and the one before
            if before is not None and before[2] is not None and (not needed or needed[-1] != len(rows) - 1):
                needed.append(len(rows) - 1)
            if root is None and digest is not None:
                needed.append(len(rows))
        rows.append((*version, dtype, shape, nbytes, digest, n, None, None, None, changed))
        before = (dtype, shape, digest) if root is None else None
    return rows, needed


def _contents_in(conn: Connection, digests: Collection[str]) -> dict[str, tuple[Any, Any, Any]]:
    """``(chunk_size, nbytes, chunk_ids)`` of ``contents`` rows by digest, unchecked (the
    engine checks what it uses)."""
    c = s.contents.c
    out: dict[str, tuple[Any, Any, Any]] = {}
    for batch in batches(list(dict.fromkeys(digests))):
        query = select(c.digest, c.chunk_size, c.nbytes, c.chunk_ids).where(c.digest.in_(batch))
        out.update((r[0], (r[1], r[2], r[3])) for r in conn.execute(query))
    return out


def manifests(catalog: Catalog, version_ids: Sequence[str]) -> dict[str, Any]:
    """The compressed manifests (``versions.manifest``, unchecked) of versions, by id."""
    out: dict[str, Any] = {}
    with catalog.read() as conn:
        for batch in batches(version_ids):
            out.update((r[0], r[1]) for r in conn.execute(
                select(s.versions.c.id, s.versions.c.manifest).where(s.versions.c.id.in_(batch))))
    return out


def contents(catalog: Catalog, digests: Iterable[str]) -> dict[str, StoredContent]:
    """``contents`` rows by digest; unknown ones left out."""
    out: dict[str, StoredContent] = {}
    with catalog.read() as conn:
        for batch in batches(list(dict.fromkeys(digests))):
            rows = conn.execute(select(s.contents).where(s.contents.c.digest.in_(batch)))
            out.update((r.digest, content_row(r)) for r in rows)
    return out


# -- lineage ----------------------------------------------------------------------------


def fork(catalog: Catalog, run: str, version_id: str) -> float:
    """Create run ``run`` forked from visible version ``version_id``; returns its creation time.

    Raises:
        RunExistsError: a run named ``run`` exists (also when created concurrently).
        RefNotFoundError: the version stopped being visible.
    """
    now = time.time()
    with catalog.write() as conn:
        visible = conn.execute(select(s.versions.c.id).where(
            s.versions.c.id == version_id, s.versions.c.state == "visible")).scalar()
        if visible is None:
            raise RefNotFoundError(version_id[:12], "the version was deleted while forking")
        created = conn.execute(upsert(conn, s.runs).on_conflict_do_nothing(index_elements=["name"])
                               .values(name=run, created_at=now, parent_version=version_id)
                               .returning(s.runs.c.id)).first()
        if created is None:
            raise RunExistsError(
                f"run {run!r} already exists; fork into a new run name (see `casckpt runs`)")
        catalog.audit_in(conn, "run.fork", f"run:{run}", {"from": version_id})
    return now


def fork_point(catalog: Catalog, run: str) -> str | None:
    """The id of the version ``run`` was forked from (None for a root run or no such run)."""
    with catalog.read() as conn:
        parent: str | None = conn.execute(
            select(s.runs.c.parent_version).where(s.runs.c.name == run)).scalar()
        return parent


class LineageRow(NamedTuple):
    """A run, where it was forked from, and how many visible versions it has."""

    name: str
    created_at: float
    parent_version: str | None
    parent_run: str | None
    fork_step: int | None
    versions: int


@dataclass(frozen=True, slots=True)
class RunSettings:
    """A run's row as the ``refs/`` records mirror it: its fork point and policies."""

    name: str
    created_at: float
    parent_version: str | None
    retention: Any
    redundancy: str | None
    delta_chain: int | None
    delta_policy: str | None = None


def _settings(row: Any) -> RunSettings:
    return RunSettings(row.name, row.created_at, row.parent_version, row.retention, row.redundancy,
                       row.delta_chain, row.delta_policy)


def run_settings(catalog: Catalog, run: str) -> RunSettings | None:
    """The settings of run ``run`` (None: no such run)."""
    with catalog.read() as conn:
        row = conn.execute(select(s.runs).where(s.runs.c.name == run)).first()
    return None if row is None else _settings(row)


def tags_and_runs(catalog: Catalog) -> tuple[list[tuple[str, str]], list[RunSettings]]:
    """Every tag (name, version id) and every run's settings, read in one transaction."""
    with catalog.read() as conn:
        tags = [(name, version) for name, version in conn.execute(select(s.tags.c.name, s.tags.c.version_id))]
        runs = [_settings(row) for row in conn.execute(select(s.runs))]
    return tags, runs


def lineage_rows(catalog: Catalog) -> list[LineageRow]:
    """Every run by name."""
    v, pv, pr = s.versions, s.versions.alias("pv"), s.runs.alias("pr")
    counts = (select(v.c.run_id, func.count(v.c.id).label("n")).where(v.c.state == "visible")
              .group_by(v.c.run_id).subquery())
    query = (
        select(s.runs.c.name, s.runs.c.created_at, s.runs.c.parent_version,
               pr.c.name.label("parent_run"), pv.c.step.label("fork_step"),
               func.coalesce(counts.c.n, 0).label("versions"))
        .select_from(
            s.runs.outerjoin(pv, pv.c.id == s.runs.c.parent_version)
            .outerjoin(pr, pr.c.id == pv.c.run_id)
            .outerjoin(counts, counts.c.run_id == s.runs.c.id))
        .order_by(s.runs.c.name)
    )
    with catalog.read() as conn:
        return [LineageRow(*row) for row in conn.execute(query)]


def best(catalog: Catalog, run: str, metric: str,
         maximize: bool) -> Version | None:
    """The visible version of ``run`` with the lowest (highest) ``metric`` (ties: the latest
    step), with its tags; None when no version records ``metric``."""
    value = s.versions.c.metrics[metric].as_float()
    query = version_query().where(s.runs.c.name == run, value.is_not(None)).order_by(
        value.desc() if maximize else value.asc(), s.versions.c.step.desc()).limit(1)
    with catalog.read() as conn:
        rows = list(conn.execute(query))
        tags = tags_of(conn, [r[0] for r in rows])
    return versions(rows, tags)[0] if rows else None


def metric_names(catalog: Catalog, run: str) -> list[str]:
    """Every metric name recorded by a visible version of ``run``, sorted."""
    names: set[str] = set()
    with catalog.read() as conn:
        for metrics in conn.execute(select(s.versions.c.metrics).join(
                s.runs, s.runs.c.id == s.versions.c.run_id)
                .where(s.runs.c.name == run, s.versions.c.state == "visible")).scalars():
            if isinstance(metrics, dict):  # check reports one that is not
                names.update(k for k in metrics if isinstance(k, str))
    return sorted(names)

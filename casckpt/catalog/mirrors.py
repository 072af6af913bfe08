"""The SQL side of mirrors (:mod:`casckpt.store_mirrors`): the ``mirrors`` and
``mirror_versions`` tables of the SOURCE store's catalog (migration 0016).

A mirror's row holds its definition and the outcome of its last run; ``mirror_versions``
one row per source version a run selected, upserted as each version is sent or fails (so a
run killed midway keeps what it recorded). Adding and removing a mirror write an audit row
in the same transaction. Removing deletes its rows (the admin's right, as deletions are).
"""

from __future__ import annotations

import difflib
import json
import time
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

from sqlalchemy import Connection, func, select

from casckpt.catalog import schema as s
from casckpt.catalog.catalog import Catalog, idempotent
from casckpt.catalog.database import batches, upsert
from casckpt.errors import InvalidArgumentError, RefNotFoundError


class MirrorRow(NamedTuple):
    """A mirror's row: its definition (``selection`` as the JSON the catalog holds) and last run."""

    name: str
    destination: str
    key_file: str | None
    selection: dict[str, Any]
    propagate_deletions: bool
    created_at: float
    run_started_at: float | None
    run_finished_at: float | None
    run_error: str | None
    dest_store_id: str | None = None


class MirrorTotals(NamedTuple):
    """What a mirror sent in all: versions the destination holds through it, raw bytes."""

    versions: int
    bytes: int


class VersionOutcome(NamedTuple):
    """One source version's row of a mirror (``state``: sent, present, failed, deleted, gone
    or unselected -- failed, then no longer selected: not shown as a failure); ``created_at``
    and ``metrics`` (JSON) are the version's, what the keep rules read; ``owned``: this
    mirror sent it (kept through a later failure: :func:`record` never clears it)."""

    version_id: str
    run: str
    step: int
    state: str
    dest_id: str | None
    chunks: int
    bytes: int
    at: float
    error: str | None
    created_at: float | None = None
    metrics: str | None = None
    owned: bool = False


def add(catalog: Catalog, row: MirrorRow, destination: str) -> None:
    """Record a new mirror (and its ``mirror.add`` audit row, naming ``destination``: the
    row's, credentials redacted -- as :func:`remove`'s).

    Raises:
        InvalidArgumentError: a mirror of that name exists.
    """
    with catalog.write() as conn:
        if conn.execute(select(s.mirrors.c.name).where(s.mirrors.c.name == row.name)).first():
            raise InvalidArgumentError(
                f"a mirror named {row.name!r} exists; pick another name, or remove it first "
                f"(casckpt mirror remove {row.name})")
        values = row._asdict() | {"selection": json.dumps(row.selection, sort_keys=True)}
        conn.execute(s.mirrors.insert().values(**values))
        catalog.audit_in(conn, "mirror.add", f"mirror:{row.name}",
                         {"destination": destination, "selection": row.selection})


def restore(catalog: Catalog, row: MirrorRow) -> None:
    """Record mirror ``row`` from its ``refs/mirrors/`` record (a catalog rebuild: no audit row,
    the rebuild records itself; a mirror of that name already here is left as it is)."""
    with catalog.write() as conn:
        if conn.execute(select(s.mirrors.c.name).where(s.mirrors.c.name == row.name)).first() is None:
            conn.execute(s.mirrors.insert().values(
                **row._asdict() | {"selection": json.dumps(row.selection, sort_keys=True)}))


def remove(catalog: Catalog, name: str, destination: str) -> None:
    """Forget mirror ``name`` and what it recorded (and write its ``mirror.remove`` audit row).

    Raises:
        RefNotFoundError: there is no such mirror.
    """
    with catalog.write() as conn:
        gone = conn.execute(s.mirrors.delete().where(s.mirrors.c.name == name)).rowcount
        if not gone:
            raise _not_found(conn, name)
        conn.execute(s.mirror_versions.delete().where(s.mirror_versions.c.mirror == name))
        conn.execute(s.mirror_tags.delete().where(s.mirror_tags.c.mirror == name))
        catalog.audit_in(conn, "mirror.remove", f"mirror:{name}", {"destination": destination})


@idempotent
def mirrors(catalog: Catalog, name: str | None = None) -> list[MirrorRow]:
    """Every mirror by name (or the one named ``name``).

    Raises:
        RefNotFoundError: ``name`` names no mirror.
    """
    query = select(*s.mirrors.c).order_by(s.mirrors.c.name)
    if name is not None:
        query = query.where(s.mirrors.c.name == name)
    with catalog.read() as conn:
        rows = [MirrorRow(*(r[:3] + (json.loads(r[3]), bool(r[4])) + r[5:])) for r in conn.execute(query)]
        if name is not None and not rows:
            raise _not_found(conn, name)
    return rows


def _not_found(conn: Connection, name: str) -> RefNotFoundError:
    names = [n for (n,) in conn.execute(select(s.mirrors.c.name).order_by(s.mirrors.c.name))]
    known = f"the mirrors are {', '.join(names)}" if names else "this store has no mirror"
    return RefNotFoundError(name, f"no mirror of that name ({known}; casckpt mirror status lists them)",
                            difflib.get_close_matches(name, names, n=3))


# A mirror's identity is its name and ``created_at`` (its generation): a run writes only while
# the mirror it started for exists, so a mirror removed while its run was sending gets no rows
# back, and one added again under the same name starts with none.


def _this_one(name: str, generation: float) -> Any:
    return (s.mirrors.c.name == name) & (s.mirrors.c.created_at == generation)


def exists(catalog: Catalog, name: str, generation: float) -> bool:
    """Whether mirror ``name`` of that ``generation`` (its ``created_at``) still exists."""
    with catalog.read() as conn:
        return conn.execute(select(s.mirrors.c.name).where(_this_one(name, generation))).first() is not None


def run_started(catalog: Catalog, name: str, generation: float) -> None:
    """A run of mirror ``name`` begins: its start is now, its end and error unknown."""
    with catalog.write() as conn:
        conn.execute(s.mirrors.update().where(_this_one(name, generation)).values(
            run_started_at=time.time(), run_finished_at=None, run_error=None))


def run_finished(catalog: Catalog, name: str, generation: float, error: str | None) -> None:
    """The run of mirror ``name`` ended (``error``: what stopped it; None: nothing did)."""
    with catalog.write() as conn:
        conn.execute(s.mirrors.update().where(_this_one(name, generation)).values(
            run_finished_at=time.time(), run_error=error))


def ran_into(catalog: Catalog, name: str, generation: float, store_id: str) -> bool:
    """Mirror ``name`` runs into the store of identity ``store_id``; True when it last ran into
    another one (wiped and made again, replaced): what it recorded there no longer holds (its
    versions are no longer its own there, nor its tags carried)."""
    with catalog.write() as conn:
        before = conn.execute(select(s.mirrors.c.dest_store_id).where(_this_one(name, generation))).scalar()
        if before != store_id:
            conn.execute(s.mirrors.update().where(_this_one(name, generation)).values(dest_store_id=store_id))
        if before is not None and before != store_id:
            mine = s.mirror_versions.c.mirror == name
            conn.execute(s.mirror_versions.update().where(mine).values(owned=False))
            conn.execute(s.mirror_tags.update().where(s.mirror_tags.c.mirror == name).values(version_id=""))
    return before is not None and before != store_id


def record(catalog: Catalog, name: str, generation: float, outcomes: Sequence[VersionOutcome]) -> None:
    """Upsert the rows of mirror ``name`` for ``outcomes`` (a version sent again replaces its
    failure; ``chunks`` and ``bytes`` add up across the runs that sent for it; ``owned`` and
    ``dest_id``, once known, stay) -- nothing when the mirror of that ``generation`` is gone
    (removed while its run was sending)."""
    if not outcomes:
        return
    table = s.mirror_versions
    with catalog.write() as conn:
        if conn.execute(select(s.mirrors.c.name).where(_this_one(name, generation))).first() is None:
            return
        statement = upsert(conn, table)
        conn.execute(statement.on_conflict_do_update(
            index_elements=[table.c.mirror, table.c.version_id],
            set_={"state": statement.excluded.state, "dest_id": func.coalesce(statement.excluded.dest_id,
                                                                             table.c.dest_id),
                  "chunks": table.c.chunks + statement.excluded.chunks,
                  "bytes": table.c.bytes + statement.excluded.bytes,
                  "at": statement.excluded.at, "error": statement.excluded.error,
                  "created_at": func.coalesce(statement.excluded.created_at, table.c.created_at),
                  "metrics": func.coalesce(statement.excluded.metrics, table.c.metrics),
                  "owned": table.c.owned | statement.excluded.owned}),
            [{"mirror": name, **o._asdict()} for o in outcomes])


def unselect_failures(catalog: Catalog, name: str, generation: float, selected: Collection[str]) -> int:
    """Retire the failures of mirror ``name`` (of that ``generation``) whose version is not in
    ``selected`` (what its selection picks now): they no longer matter, and leave its status.
    One this mirror had sent (``owned``: the destination holds it through the mirror) is
    ``sent`` again, so that propagating deletions still deletes it there; the others are
    ``unselected``. Returns how many."""
    table = s.mirror_versions
    with catalog.write() as conn:
        if conn.execute(select(s.mirrors.c.name).where(_this_one(name, generation))).first() is None:
            return 0
        failed = conn.execute(select(table.c.version_id, table.c.owned).where(
            (table.c.mirror == name) & (table.c.state == "failed"))).all()
        for owned, state in ((True, "sent"), (False, "unselected")):
            stale = [v for v, mine in failed if bool(mine) is owned and v not in selected]
            for batch in batches(stale):
                conn.execute(table.update().where((table.c.mirror == name) & table.c.version_id.in_(batch))
                             .values(state=state, error=None, at=time.time()))
    return sum(1 for v, _ in failed if v not in selected)


def carried(catalog: Catalog, name: str) -> dict[str, str]:
    """The source tags mirror ``name`` last carried to its destination, each with the source
    version it named then."""
    with catalog.read() as conn:
        rows = conn.execute(select(s.mirror_tags.c.tag, s.mirror_tags.c.version_id)
                            .where(s.mirror_tags.c.mirror == name))
        return {tag: version_id for tag, version_id in rows}


def carry(catalog: Catalog, name: str, generation: float, tags: dict[str, str]) -> None:
    """Remember that mirror ``name`` (of that ``generation``: nothing once it is gone) carried
    each of ``tags`` (tag -> the source version it names) to its destination."""
    if not tags:
        return
    table = s.mirror_tags
    with catalog.write() as conn:
        if conn.execute(select(s.mirrors.c.name).where(_this_one(name, generation))).first() is None:
            return
        statement = upsert(conn, table)
        conn.execute(statement.on_conflict_do_update(
            index_elements=[table.c.mirror, table.c.tag], set_={"version_id": statement.excluded.version_id}),
            [{"mirror": name, "tag": tag, "version_id": v} for tag, v in tags.items()])


@idempotent
def outcomes(catalog: Catalog, name: str, state: str | None = None) -> list[VersionOutcome]:
    """The version rows of mirror ``name`` (only those in ``state``), by run and step."""
    table = s.mirror_versions
    query = select(table.c.version_id, table.c.run, table.c.step, table.c.state, table.c.dest_id,
                   table.c.chunks, table.c.bytes, table.c.at, table.c.error, table.c.created_at,
                   table.c.metrics, table.c.owned).where(table.c.mirror == name)
    if state is not None:
        query = query.where(table.c.state == state)
    with catalog.read() as conn:
        return [VersionOutcome._make((*r[:-1], bool(r[-1])))
                for r in conn.execute(query.order_by(table.c.run, table.c.step))]


@idempotent
def totals(catalog: Catalog) -> dict[str, MirrorTotals]:
    """Per mirror: the versions the destination holds through it and the raw bytes it sent."""
    table = s.mirror_versions
    query = (select(table.c.mirror, func.count(), func.coalesce(func.sum(table.c.bytes), 0))
             .where(table.c.state == "sent").group_by(table.c.mirror))
    with catalog.read() as conn:
        return {name: MirrorTotals(int(n), int(b)) for name, n, b in conn.execute(query)}

"""``tree_changes``: what each tree version changed against its parent, read by tensor history.

A version listed in ``tree_indexed`` has a row for every tensor path whose leaf it did not
reuse from its parent's tree (``versions.parent_id``), and one (dtype and digest NULL) for
every path its parent had and it lacks; a path without a row is the parent's tensor,
unchanged. Written in the publishing transaction of a commit
(:mod:`casckpt.engine.write.treeindex`) or of a copy (the source's rows: :func:`recorded`)
or, for versions committed without them, by :func:`record` (``casckpt migrate-trees``,
catalog rebuilds: whoever can read the trees). Rows go with their version (:func:`forget`:
gc's purge). Paths are interned in ``tree_paths``, whose rows are never deleted (so an id
read once keeps its path).

The catalog holds tensor paths, dtypes, shapes and the (keyed) tensor digests in the clear
already (docs/SECURITY.md): these rows repeat what the version's tree nodes hold.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, delete, select

from casckpt.catalog import schema as s
from casckpt.catalog.database import batches, upsert

Change = tuple[str, str | None, str | None, int, bytes | None, int | None]
"""A row: path, dtype, shape (JSON text), logical bytes, digest (32 bytes: ``tensors.digest``'s
hex digits), changed bytes (see module)."""


def path_ids(conn: Connection, paths: Collection[str], known: Mapping[str, int]) -> dict[str, int]:
    """Ids of ``paths`` not in ``known`` (interned now where missing), within ``conn``'s transaction."""
    wanted = [p for p in paths if p not in known]
    found: dict[str, int] = {}
    p = s.tree_paths.c
    for batch in batches(wanted):
        found.update((r[1], r[0]) for r in conn.execute(select(p.id, p.path).where(p.path.in_(batch))))
    missing = [{"path": path} for path in wanted if path not in found]
    if missing:
        conn.execute(upsert(conn, s.tree_paths).on_conflict_do_nothing(index_elements=["path"]), missing)
        for batch in batches([m["path"] for m in missing]):
            found.update((r[1], r[0]) for r in conn.execute(select(p.id, p.path).where(p.path.in_(batch))))
    return found


def insert(conn: Connection, version_id: str, base_id: str | None, rows: Sequence[Change],
           known: Mapping[str, int]) -> dict[str, int]:
    """Record version ``version_id``'s rows against version ``base_id`` (replacing any it had);
    returns the path ids it read or made beyond ``known`` (for the caller to keep once the
    transaction commits).

    The rows go to the driver as plain tuples in one ``executemany``: a commit that changed
    every tensor writes one row per tensor, and building them is most of what it costs."""
    key = conn.execute(s.tree_indexed.insert().values(version_id=version_id, base_id=base_id)
                       .returning(s.tree_indexed.c.key)).scalar_one()
    if not rows:
        return {}
    new = path_ids(conn, {r[0] for r in rows}, known)
    ids = {**known, **new} if new else known
    mark = "?" if conn.dialect.paramstyle == "qmark" else "%s"
    conn.exec_driver_sql(
        "INSERT INTO tree_changes (path_id, version_key, dtype, shape, nbytes, digest, changed_bytes) "
        f"VALUES ({', '.join([mark] * 7)})",
        [(ids[p], key, d, sh, n, h, c) for p, d, sh, n, h, c in rows])
    return new


def recorded(conn: Connection, version_id: str) -> tuple[str | None, list[Change]] | None:
    """Version ``version_id``'s rows and the version they are against (None: none recorded),
    as :func:`insert` takes them (a copy carries them to another store)."""
    i, t, p = s.tree_indexed.c, s.tree_changes.c, s.tree_paths.c
    found = conn.execute(select(i.key, i.base_id).where(i.version_id == version_id)).first()
    if found is None:
        return None
    rows = conn.execute(select(p.path, t.dtype, t.shape, t.nbytes, t.digest, t.changed_bytes)
                        .join(s.tree_paths, p.id == t.path_id).where(t.version_key == found[0])
                        .order_by(p.path))
    return found[1], [(r[0], r[1], r[2], r[3], bytes(r[4]) if r[4] is not None else None, r[5])
                      for r in rows]


def replace(conn: Connection, rows: Mapping[str, tuple[str | None, Sequence[Change]]],
            known: Mapping[str, int]) -> dict[str, int]:
    """Record the rows of several versions (id -> (base id, rows)), replacing theirs."""
    forget(conn, list(rows))
    new: dict[str, int] = {}
    for version_id, (base_id, changes) in rows.items():
        new.update(insert(conn, version_id, base_id, changes, {**known, **new}))
    return new


def forget(conn: Connection, version_ids: Sequence[str]) -> None:
    """Delete the rows of versions ``version_ids`` (their version rows are going)."""
    i = s.tree_indexed.c
    keys = select(i.key).where(i.version_id.in_(version_ids)).scalar_subquery()
    conn.execute(delete(s.tree_changes).where(s.tree_changes.c.version_key.in_(keys)))
    conn.execute(delete(s.tree_indexed).where(i.version_id.in_(version_ids)))


def unindexed(conn: Connection, limit: int | None = None) -> list[tuple[str, str | None]]:
    """``(id, parent_id)`` of tree versions without recorded rows, oldest first."""
    v = s.versions.c
    query = (select(v.id, v.parent_id).where(
        v.tree_root.is_not(None), ~v.id.in_(select(s.tree_indexed.c.version_id)))
        .order_by(v.committed_at, v.id))
    return [(r[0], r[1]) for r in conn.execute(query.limit(limit) if limit else query)]


def indexed_of(conn: Connection, run_ids: Collection[int]) -> dict[int, tuple[str, str | None]]:
    """Key -> (id, base id) of the versions of runs ``run_ids`` with recorded rows."""
    i, v = s.tree_indexed.c, s.versions.c
    return {r[0]: (r[1], r[2]) for r in conn.execute(
        select(i.key, i.version_id, i.base_id).join(s.versions, v.id == i.version_id)
        .where(v.run_id.in_(run_ids)))}


def states(conn: Connection, path: str, keys: Mapping[int, tuple[str, str | None]]
           ) -> dict[str, tuple[Any, ...]]:
    """Version id -> ``(dtype, shape, nbytes, digest, changed_bytes)`` of the rows of ``path``
    of the versions ``keys`` names (by key)."""
    pid = conn.execute(select(s.tree_paths.c.id).where(s.tree_paths.c.path == path)).scalar()
    if pid is None or not keys:
        return {}
    t = s.tree_changes.c
    get = keys.get
    out: dict[str, tuple[Any, ...]] = {}
    for r in conn.execute(select(t.version_key, t.dtype, t.shape, t.nbytes, t.digest, t.changed_bytes)
                          .where(t.path_id == pid)):
        if (found := get(r[0])) is not None:
            digest = r[4]
            out[found[0]] = (r[1], r[2], r[3], bytes(digest).hex() if digest is not None else None, r[5])
    return out

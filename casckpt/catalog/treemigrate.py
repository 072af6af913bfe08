"""The SQL of versions migrated to trees: which versions lack one, the migration's publishing
transaction, and the tree root a version's row names (see :mod:`casckpt.engine.maintenance.treemigrate`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import delete, select, update

from casckpt.catalog import schema as s
from casckpt.catalog.catalog import Catalog
from casckpt.catalog.database import insert_ignore
from casckpt.catalog.gc import drop_unused_contents
from casckpt.catalog.publish import MissingChunksError, revive_or_missing


def without_tree(catalog: Catalog) -> list[tuple[str, str]]:
    """``(version id, run)`` of every visible version without a tree root, by run and step
    (manifests of version 1 and 2: only the engine, reading them, tells which)."""
    v = s.versions
    with catalog.read() as conn:
        rows = conn.execute(select(v.c.id, s.runs.c.name).join(s.runs, s.runs.c.id == v.c.run_id)
                            .where(v.c.state == "visible", v.c.tree_root.is_(None))
                            .order_by(s.runs.c.name, v.c.step)).all()
    return [(r[0], r[1]) for r in rows]


def tree_root(catalog: Catalog, version_id: str) -> str | None:
    """The tree root the row of ``version_id`` names (None: no tree, or no such version)."""
    with catalog.read() as conn:
        return conn.execute(select(s.versions.c.tree_root).where(s.versions.c.id == version_id)).scalar()


def adopt_trees(catalog: Catalog, roots: Mapping[str, str], node_rows: Sequence[dict[str, Any]],
                node_ids: Sequence[str]) -> tuple[int, int]:
    """ONE transaction: give versions their tree (``roots``: version id -> root node id).

    Every node chunk is re-checked first and revived when condemned, as publishing a commit
    does (:func:`~casckpt.catalog.publish.revive_or_missing`); then the node rows the catalog lacks are added,
    each version still visible and without a tree gets its root, its ``tensors`` rows go, and
    so do the ``contents`` rows no tensor row uses anymore. Idempotent: a version that has a
    tree already is left alone.

    Returns how many versions got their tree, and how many tensor rows were deleted.

    Raises:
        MissingChunksError: a node chunk is gone (gc swept it); nothing was written.
    """
    v, t = s.versions, s.tensors
    with catalog.write() as conn:
        missing = revive_or_missing(conn, list(node_ids))
        if missing:
            raise MissingChunksError(missing)
        ids = list(conn.execute(select(v.c.id).where(
            v.c.id.in_(list(roots)), v.c.state == "visible", v.c.tree_root.is_(None)
        ).with_for_update()).scalars())
        insert_ignore(conn, s.tree_nodes, list(node_rows), "id")
        deleted, digests = 0, list[str]()
        for version_id in ids:
            conn.execute(update(v).where(v.c.id == version_id).values(tree_root=roots[version_id]))
            used = select(t.c.digest).where(t.c.version_id == version_id).distinct()
            digests += conn.execute(used).scalars()
            deleted += int(conn.execute(delete(t).where(t.c.version_id == version_id)).rowcount)
        drop_unused_contents(conn, digests)
    return len(ids), deleted

"""Tree node rows (``tree_nodes``): a tree version's nodes, compressed, by id. Publishing adds
a version's new nodes in its own transaction (:meth:`Catalog.add_version`); these read them,
and repair writes verified copies over damaged rows. Each call is retried while the database
is unreachable (they are idempotent).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, select

from casckpt.catalog import schema as s
from casckpt.catalog.catalog import Catalog, idempotent
from casckpt.catalog.database import batches


def _bodies(conn: Connection, ids: Sequence[str]) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    for batch in batches(ids):
        out += [(r[0], bytes(r[1])) for r in conn.execute(
            select(s.tree_nodes.c.id, s.tree_nodes.c.body).where(s.tree_nodes.c.id.in_(batch)))]
    return out


@idempotent
def tree_nodes(catalog: Catalog, ids: Sequence[str]) -> dict[str, bytes]:
    """Compressed bodies of the tree nodes among ``ids`` the catalog holds."""
    with catalog.read() as conn:
        return dict(_bodies(conn, list(dict.fromkeys(ids))))


@idempotent
def tree_node_ids(catalog: Catalog, ids: Sequence[str]) -> set[str]:
    """The tree nodes among ``ids`` the catalog has a row for."""
    out: set[str] = set()
    with catalog.read() as conn:
        for batch in batches(list(dict.fromkeys(ids))):
            out.update(conn.execute(select(s.tree_nodes.c.id).where(s.tree_nodes.c.id.in_(batch))).scalars())
    return out


@idempotent
def replace_tree_nodes(catalog: Catalog, rows: Sequence[dict[str, Any]]) -> None:
    """Write tree node rows (id, zstd body) over any there (repair, with verified nodes)."""
    with catalog.write() as conn:
        for batch in batches(rows):
            conn.execute(s.tree_nodes.delete().where(s.tree_nodes.c.id.in_([r["id"] for r in batch])))
            conn.execute(s.tree_nodes.insert(), batch)

"""The publishing transaction's checks, inside the caller's transaction: every chunk a
version references is live (condemned ones revived, with their delta bases), and the
``fast`` packs it needs are recorded (:mod:`casckpt.catalog.tiers`). Used by
:meth:`~casckpt.catalog.catalog.Catalog.add_version` and by what revives versions
(undelete, tree migration).
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection, func, select, update

from casckpt.catalog import schema as s
from casckpt.catalog.database import batches, upsert
from casckpt.errors import CatalogError


class MissingChunksError(CatalogError):
    """A version references chunks the catalog does not hold live (e.g. removed by GC)."""

    def __init__(self, missing: set[str]) -> None:
        self.missing = missing
        super().__init__(f"{len(missing)} referenced chunks are not live in the catalog")


def revive_or_missing(conn: Connection, ids: list[str], needed: set[str] | None = None) -> set[str]:
    """Revive referenced chunks GC condemned but has not swept, and the delta bases they
    need, transitively; return those (chunks or bases) that are gone. ``needed``, when
    given, receives every chunk read (``ids`` and their bases, transitively)."""
    wanted, missing = list(ids), set()
    seen = needed if needed is not None else set()
    seen.update(wanted)
    while wanted:
        bases: set[str] = set()
        for batch in batches(wanted):
            condemned = s.chunks.c.id.in_(batch) & (s.chunks.c.state == "condemned")
            conn.execute(s.chunks.update().where(condemned).values(state="live", condemned_at=None))
            rows = conn.execute(
                select(s.chunks.c.id, s.chunks.c.base_id)
                .where(s.chunks.c.id.in_(batch), s.chunks.c.state == "live")
                .with_for_update(read=True)  # PostgreSQL: GC cannot condemn them until we commit
            ).all()
            missing.update(set(batch) - {row[0] for row in rows})
            bases.update(row[1] for row in rows if row[1] is not None and row[1] not in seen)
        seen |= bases
        wanted = list(bases)
    return missing


def insert_deps(conn: Connection, version_id: str, chunk_ids: Sequence[str]) -> int:
    """Within a publishing transaction: record the ``fast`` packs ``chunk_ids`` lie in as the
    version's dependencies, and make it ``fast`` if there are any. Returns how many.

    One indexed probe when the store has no fast pack at all; otherwise whichever is smaller
    is matched against the other: the version's chunks, or the chunks waiting to drain."""
    p, c = s.packs, s.chunks
    if conn.execute(select(p.c.id).where(p.c.state == "fast").limit(1)).first() is None:
        return 0
    in_fast = select(c.c.id, c.c.pack_id).join(p, p.c.id == c.c.pack_id).where(p.c.state == "fast")
    waiting = conn.execute(select(func.count()).select_from(in_fast.subquery())).scalar_one()
    packs: set[str] = set()
    if waiting <= len(chunk_ids):  # the chunks waiting to drain are the fewer: match them here
        wanted = set(chunk_ids)
        packs.update(pack for chunk, pack in conn.execute(in_fast) if chunk in wanted)
    else:
        for batch in batches(chunk_ids):
            packs.update(conn.execute(select(c.c.pack_id).join(p, p.c.id == c.c.pack_id).where(
                c.c.id.in_(batch), p.c.state == "fast").distinct()).scalars())
    if packs:
        conn.execute(upsert(conn, s.tier_deps).on_conflict_do_nothing(
            index_elements=["version_id", "pack_id"]),
            [{"version_id": version_id, "pack_id": pid} for pid in sorted(packs)])
        conn.execute(update(s.versions).where(s.versions.c.id == version_id,
                                               s.versions.c.durability == "durable")
                     .values(durability="fast"))
    return len(packs)

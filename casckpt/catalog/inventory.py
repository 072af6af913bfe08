"""What the store holds, as check, repair, rebuild and ``store.ops.stats`` read it: the live packs,
the chunks of a pack, every live chunk (in bounded batches), and the store's counts and byte
totals. Reads only; each call but the batched walk is retried while the database is
unreachable.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sqlalchemy import Row, exists, func, select

from casckpt.catalog import schema as s
from casckpt.catalog.catalog import Catalog, idempotent


@idempotent
def live_packs(catalog: Catalog) -> list[Row[Any]]:
    """Every live pack row."""
    with catalog.read() as conn:
        return list(conn.execute(select(s.packs).where(s.packs.c.state == "live")))


@idempotent
def chunks_of_pack(catalog: Catalog, pack_id: str) -> list[Row[Any]]:
    """Every chunk row stored in a pack, by offset."""
    with catalog.read() as conn:
        return list(conn.execute(
            select(s.chunks).where(s.chunks.c.pack_id == pack_id).order_by(s.chunks.c.offset)))


def live_chunk_batches(catalog: Catalog, size: int = 10_000) -> Iterator[list[Any]]:
    """Every live chunk row, in batches by id (keyset pagination: bounded memory)."""
    after = ""
    while True:
        with catalog.read() as conn:
            batch = list(conn.execute(
                select(s.chunks.c.id, s.chunks.c.pack_id, s.chunks.c.offset, s.chunks.c.stored_len,
                       s.chunks.c.raw_len, s.chunks.c.codec)
                .where(s.chunks.c.state == "live", s.chunks.c.id > after)
                .order_by(s.chunks.c.id).limit(size)))
        if not batch:
            return
        yield batch
        after = batch[-1].id


@idempotent
def live_chunk_count(catalog: Catalog) -> int:
    """Live chunks, tree nodes included (what a full check reads)."""
    with catalog.read() as conn:
        return int(conn.execute(select(func.count(s.chunks.c.id))
                                .where(s.chunks.c.state == "live")).scalar_one())


@idempotent
def totals(catalog: Catalog) -> dict[str, int]:
    """Counts and byte sums for ``store.ops.stats`` (chunks: of tensor data, tree nodes left out)."""
    v, c, p = s.versions, s.chunks, s.packs
    with catalog.read() as conn:
        vrow = conn.execute(select(func.count(v.c.id), func.coalesce(func.sum(v.c.logical_bytes), 0),
                                   func.count(v.c.tree_root))
                            .where(v.c.state == "visible")).one()
        crow = conn.execute(select(func.count(c.c.id), func.coalesce(func.sum(c.c.raw_len), 0),
                                   func.coalesce(func.sum(c.c.stored_len), 0))
                            .where(c.c.state == "live",  # tensor data: tree nodes are not
                                   ~exists().where(s.tree_nodes.c.id == c.c.id))).one()
        prow = conn.execute(select(func.count(p.c.id), func.coalesce(func.sum(p.c.size), 0))
                            .where(p.c.state == "live")).one()
        shard_bytes = conn.execute(select(func.coalesce(func.sum(s.shards.c.size), 0))
                                   .where(s.shards.c.state == "ok")).scalar_one()
        runs = conn.execute(select(func.count(s.runs.c.id))).scalar_one()
        tags = conn.execute(select(func.count(s.tags.c.name))).scalar_one()
    return {
        "runs": runs, "versions": vrow[0], "tags": tags, "chunks": crow[0], "packs": prow[0],
        "logical_bytes": int(vrow[1]), "unique_bytes": int(crow[1]),
        "stored_bytes": int(crow[2]), "pack_bytes": int(prow[1]),
        "location_bytes": int(shard_bytes), "versions_without_tree": vrow[0] - vrow[2],
    }

"""Pack and chunk values: the values the pack layer and the catalog exchange about packs,
their shards and the chunks in them, and the statements that insert their rows.

A pack row and its shard rows are inserted together (:func:`insert_pack`), keeping
rows another writer inserted first; chunk rows are upserted (:func:`upsert_chunks`)
so a chunk GC condemned, or whose pack is lost, points at the new copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection

from casckpt.catalog import schema as s
from casckpt.catalog.database import insert_ignore, upsert

if TYPE_CHECKING:  # the pack format (and its codecs) loads where packs are read or written
    from casckpt.format.pack import PackEntry


@dataclass(frozen=True, slots=True)
class ChunkLocation:
    """Where a live chunk's encoded bytes are."""

    chunk_id: str
    pack_id: str
    pack_name: str
    offset: int
    stored_len: int
    raw_len: int
    codec: int
    base_id: str | None = None  # the chunk a delta-coded chunk is decoded against

    def entry(self) -> PackEntry:
        """The pack entry this location describes."""
        from casckpt.format.pack import PackEntry

        return PackEntry(bytes.fromhex(self.chunk_id), self.offset, self.stored_len,
                         self.raw_len, self.codec, bytes.fromhex(self.base_id) if self.base_id else None)


@dataclass(frozen=True, slots=True)
class ShardRow:
    """Where one copy (``none``, ``replicate``) or shard (``ec``) of a pack lives.

    ``state`` is ``ok``, ``missing`` (not written, or found gone) or
    ``corrupt`` (found damaged); the last two are repair's queue.
    """

    index: int
    location_id: int
    key: str
    size: int
    checksum: str | None = None
    state: str = "ok"
    verified_at: float | None = None


@dataclass(frozen=True, slots=True)
class PackLayout:
    """How a pack is stored: its scheme and every shard.

    ``scheme`` is ``none``, ``replicate`` or ``ec``; for ``ec``, data shard
    ``i`` holds pack bytes ``[i*stripe, (i+1)*stripe)`` from payload byte
    ``data_offset`` (after the shard header). A pack on a fast ``tier`` that has not
    drained yet has no shards; its scheme, ``k`` and ``m`` say what the drain makes of it.
    """

    id: str
    key: str
    size: int
    scheme: str = "none"
    k: int = 1
    m: int = 0
    algorithm: str | None = None
    stripe: int | None = None
    data_offset: int | None = None
    shards: tuple[ShardRow, ...] = ()
    tier: str | None = None  # the fast tier holding it, not drained (no shards): engine/tiering/tier.py

    def shard(self, index: int) -> ShardRow | None:
        """The shard with this index, if recorded."""
        return next((sh for sh in self.shards if sh.index == index), None)


@dataclass(frozen=True, slots=True)
class StoredPack:
    """A pack that has just been made durable in the blob store."""

    layout: PackLayout
    entries: Sequence[PackEntry]

    @property
    def id(self) -> str:
        """The pack id."""
        return self.layout.id

    @property
    def key(self) -> str:
        """The pack's base object name."""
        return self.layout.key

    @property
    def size(self) -> int:
        """The pack's length in bytes."""
        return self.layout.size


def insert_pack(conn: Connection, layout: PackLayout, chunks: int, now: float) -> None:
    """Insert a pack row and its shard rows (rows that exist are kept); a pack on a fast tier
    (``layout.tier``) is recorded ``fast``, waiting for its drain."""
    insert_ignore(conn, s.packs, [{
        "id": layout.id, "key": layout.key, "size": layout.size, "chunks": chunks,
        "state": "live" if layout.tier is None else "fast", "tier": layout.tier,
        "created_at": now, "verified_at": None, "scheme": layout.scheme,
        "k": layout.k, "m": layout.m, "algorithm": layout.algorithm, "stripe": layout.stripe,
        "data_offset": layout.data_offset,
    }], "id")
    insert_shards(conn, layout)


def insert_shards(conn: Connection, layout: PackLayout) -> None:
    """Insert the shard rows of ``layout`` (rows that exist are kept)."""
    rows = [{"pack_id": layout.id, "idx": sh.index, "location_id": sh.location_id, "key": sh.key,
             "size": sh.size, "checksum": sh.checksum, "state": sh.state, "verified_at": None}
            for sh in layout.shards]
    if rows:
        conn.execute(upsert(conn, s.shards).on_conflict_do_nothing(
            index_elements=["pack_id", "idx"]), rows)


def upsert_chunks(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """Insert chunk rows; a row GC has condemned, or whose pack is lost, is pointed at this
    new copy and made live.

    A live row is kept as it is (another writer stored the chunk first; this
    copy is dead space in its pack until repacking).
    """
    if not rows:
        return
    stmt = upsert(conn, s.chunks)
    conn.execute(stmt.on_conflict_do_update(
        index_elements=["id"],
        set_={c: stmt.excluded[c] for c in ("pack_id", "offset", "stored_len", "raw_len", "codec",
                                             "base_id", "state", "created_at", "condemned_at")},
        where=(s.chunks.c.state == "condemned") | (s.chunks.c.state == "lost"),  # no IN: executemany
    ), rows)

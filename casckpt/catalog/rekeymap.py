"""The SQL side of the re-key map (:mod:`casckpt.engine.copying.rekeymap`): the ``rekey_map``
table of the DESTINATION store's catalog (migration 0018).

One row per source chunk a copy across chunk-id keys committed here: ``key`` (this store's
keyed digest of the source store's identity and the source's chunk id; the engine derives
it) -> ``chunk_id`` (this store's id of the same bytes). Rows are only ever inserted (the
same key always names the same bytes, so a row never changes); whether the chunk is still
held is the ``chunks`` table's to say, asked separately (gc sweeps chunks, not these rows).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sqlalchemy import select

from casckpt.catalog import schema as s
from casckpt.catalog.catalog import Catalog, idempotent
from casckpt.catalog.database import batches, insert_ignore


@idempotent  # rows that exist are kept
def record(catalog: Catalog, pairs: Mapping[str, str]) -> None:
    """Remember ``pairs`` (key hex -> this store's chunk id hex); keys known already are kept."""
    rows = [{"key": k, "chunk_id": c} for k, c in pairs.items()]
    with catalog.write() as conn:
        for batch in batches(rows):
            insert_ignore(conn, s.rekey_map, batch, "key")


@idempotent
def lookup(catalog: Catalog, keys: Sequence[str]) -> dict[str, str]:
    """The chunk id (hex) recorded for each of ``keys`` that has one."""
    found: dict[str, str] = {}
    with catalog.read() as conn:
        for batch in batches(list(dict.fromkeys(keys))):
            found.update((k, c) for k, c in conn.execute(
                select(s.rekey_map.c.key, s.rekey_map.c.chunk_id).where(s.rekey_map.c.key.in_(batch))))
    return found

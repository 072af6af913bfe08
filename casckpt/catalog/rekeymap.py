"""The SQL side of the re-key map (:mod:`casckpt.engine.copying.rekeymap`): the ``rekey_map``
table of the DESTINATION store's catalog (migration 0018).

One row per source chunk a copy across chunk-id keys committed here: ``key`` (this store's
keyed digest of the source store's identity and the source's chunk id; the engine derives
it) -> ``chunk_id`` (this store's id of the same bytes). Copies only insert rows (the
same key always names the same bytes, so a row never changes); a gc sweep drops the rows of
the chunks it removes; whether a chunk is still held is the ``chunks`` table's to say.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence

from sqlalchemy import select

from casckpt.catalog import schema as s
from casckpt.catalog.catalog import Catalog, idempotent
from casckpt.catalog.database import batches, insert_ignore
from casckpt.catalog.grants import missing_of

log = logging.getLogger(__name__)
_DENIED: weakref.WeakKeyDictionary[Catalog, str | None] = weakref.WeakKeyDictionary()


def denied(catalog: Catalog) -> str | None:
    """Why these credentials may not use the map (None: they may), asked once per open
    catalog and logged as a warning then. A writer role granted before migration 0018 lacks
    its rights: it still commits (the table is one of ``schema.OPTIONAL_TABLES``), and its
    re-keyed copies read every byte from the source, as before the map."""
    if catalog not in _DENIED:
        missing = missing_of(catalog, [("rekey_map", "SELECT"), ("rekey_map", "INSERT")])
        _DENIED[catalog] = None if not missing else (
            f"these catalog credentials lack {missing[0]}: a copy across keys reads every byte "
            "from the source and remembers nothing for the next; the tables' owner grants the "
            "rights by running the statements of `casckpt init --print-grants writer` again")
        if _DENIED[catalog] is not None:
            log.warning("%s", _DENIED[catalog])
    return _DENIED[catalog]


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

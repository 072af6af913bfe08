"""An encrypted store's key record in the catalog (``store_info``, key ``key_record``)."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import select, update

from casckpt.catalog import schema as s
from casckpt.catalog.catalog import Catalog
from casckpt.catalog.database import insert_ignore

_KEY = "key_record"


def read_key_record(catalog: Catalog) -> dict[str, Any] | None:
    """The key record's JSON document (None: the store is not encrypted).

    Raises:
        CatalogError: the catalog cannot be read.
        ValueError: the row is there but holds no JSON object (``null`` included: a row that
            is there is never read as "not encrypted", or whoever may UPDATE ``store_info``
            -- the writer role -- could make keyless processes write plaintext).
    """
    with catalog.read() as conn:
        value = conn.execute(select(s.store_info.c.value).where(s.store_info.c.key == _KEY)).scalar()
    if value is None:
        return None
    doc = json.loads(value)
    if not isinstance(doc, dict):
        raise ValueError(f"it holds a JSON {type(doc).__name__}, not a key record")
    return doc


def _text(doc: dict[str, Any]) -> str:
    return json.dumps(doc, sort_keys=True)


def create_key_record(catalog: Catalog, doc: dict[str, Any]) -> None:
    """Record ``doc`` as the store's key record unless it has one: of two processes creating
    one store at once, the first record written wins (each then unlocks the one kept). The
    audit trail gets a ``key.create`` row when this call's record is the one kept."""
    with catalog.write() as conn:
        insert_ignore(conn, s.store_info, [{"key": _KEY, "value": _text(doc)}], "key")
        kept = conn.execute(select(s.store_info.c.value).where(s.store_info.c.key == _KEY)).scalar()
        if kept is not None and json.loads(kept) == doc:
            catalog.audit_in(conn, "key.create", None, {"keys": [slot["id"] for slot in doc["slots"]]})


def replace_key_record(catalog: Catalog, old: dict[str, Any], new: dict[str, Any],
                       action: str, detail: dict[str, Any]) -> bool:
    """Replace the key record by ``new`` if it is still ``old`` (read, compared and written in one
    transaction, the row locked on PostgreSQL, with its audit row ``action``); False: another
    change came first."""
    with catalog.write() as conn:
        current = conn.execute(select(s.store_info.c.value).where(s.store_info.c.key == _KEY)
                               .with_for_update()).scalar()
        if current is None or json.loads(current) != old:
            return False
        conn.execute(update(s.store_info).where(s.store_info.c.key == _KEY).values(value=_text(new)))
        catalog.audit_in(conn, action, None, detail)
        return True

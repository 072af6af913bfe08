"""An encrypted store's key record in the catalog (``store_info``, key ``key_record``)."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import delete, select

from casckpt.catalog import schema as s
from casckpt.catalog.catalog import Catalog
from casckpt.catalog.database import insert_ignore

_KEY = "key_record"


def read_key_record(catalog: Catalog) -> dict[str, Any] | None:
    """The key record's JSON document (None: the store is not encrypted).

    Raises:
        CatalogError: the catalog cannot be read.
    """
    with catalog.read() as conn:
        value = conn.execute(select(s.store_info.c.value).where(s.store_info.c.key == _KEY)).scalar()
    if value is None:
        return None
    doc: dict[str, Any] = json.loads(value)
    return doc


def write_key_record(catalog: Catalog, doc: dict[str, Any]) -> None:
    """Make ``doc`` the store's key record (replacing the one there), in one transaction."""
    with catalog.write() as conn:
        conn.execute(delete(s.store_info).where(s.store_info.c.key == _KEY))
        insert_ignore(conn, s.store_info, [{"key": _KEY, "value": json.dumps(doc, sort_keys=True)}], "key")

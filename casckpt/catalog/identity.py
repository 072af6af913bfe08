"""The catalog's side of the store identity (``store_info``): store id, creation time, generation."""

from __future__ import annotations

from sqlalchemy import delete, select

from casckpt.catalog import schema as s
from casckpt.catalog.catalog import Catalog, insert_ignore
from casckpt.errors import CatalogError
from casckpt.format.identity import StoreIdentity


def read(catalog: Catalog) -> StoreIdentity:
    """The identity this catalog records.

    Raises:
        CatalogError: ``store_info`` lacks it or holds a malformed value.
    """
    with catalog.read() as conn:
        values = {row[0]: row[1] for row in conn.execute(select(s.store_info.c.key, s.store_info.c.value))}
    try:
        return StoreIdentity(values["store_id"], float(values["created_at"]), int(values["generation"]))
    except (KeyError, ValueError) as exc:
        raise CatalogError(
            f"the catalog at {catalog.where} records no valid store identity ({exc!r}); it is "
            "damaged: rebuild it from the blob locations (`casckpt catalog rebuild`) into a new, "
            "empty catalog") from None


def write(catalog: Catalog, identity: StoreIdentity) -> None:
    """Make the catalog record ``identity`` (a catalog rebuild adopting the locations' store)."""
    rows = [{"key": "store_id", "value": identity.store_id},
            {"key": "created_at", "value": repr(identity.created_at)},
            {"key": "generation", "value": str(identity.generation)}]
    with catalog.write() as conn:
        conn.execute(delete(s.store_info).where(s.store_info.c.key.in_([r["key"] for r in rows])))
        insert_ignore(conn, s.store_info, rows, "key")
    catalog.store_id = identity.store_id

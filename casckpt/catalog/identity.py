"""The catalog's side of the store identity (``store_info``): store id, creation time, generation."""

from __future__ import annotations

from sqlalchemy import delete, select, update

from casckpt.catalog import schema as s
from casckpt.catalog.catalog import Catalog
from casckpt.catalog.database import insert_ignore
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


def next_record_seq(catalog: Catalog) -> int:
    """The next value of the store's record counter (each ``refs/`` record written takes one,
    so a catalog rebuild can tell the newest copy of a record by counter, not by clock)."""
    with catalog.write() as conn:
        current = conn.execute(select(s.store_info.c.value).where(s.store_info.c.key == "record_seq")
                               .with_for_update()).scalar()
        value = int(current or 0) + 1
        if current is None:
            insert_ignore(conn, s.store_info, [{"key": "record_seq", "value": str(value)}], "key")
        else:
            conn.execute(update(s.store_info).where(s.store_info.c.key == "record_seq")
                         .values(value=str(value)))
    return value


def raise_record_seq(catalog: Catalog, at_least: int) -> None:
    """Make the counter continue above every record found (a rebuild's last step)."""
    with catalog.write() as conn:
        conn.execute(delete(s.store_info).where(s.store_info.c.key == "record_seq"))
        insert_ignore(conn, s.store_info, [{"key": "record_seq", "value": str(at_least)}], "key")


def set_rebuilding(catalog: Catalog, rebuilding: bool) -> None:
    """Mark the catalog as being filled by a catalog rebuild (or no longer): a rebuild killed
    midway leaves the mark, and a catalog so marked is never used as the store's."""
    with catalog.write() as conn:
        conn.execute(delete(s.store_info).where(s.store_info.c.key == "rebuilding"))
        if rebuilding:
            insert_ignore(conn, s.store_info, [{"key": "rebuilding", "value": "1"}], "key")


def rebuilding(catalog: Catalog) -> bool:
    """Whether a catalog rebuild into this catalog started and did not finish."""
    with catalog.read() as conn:
        return conn.execute(select(s.store_info.c.value)
                            .where(s.store_info.c.key == "rebuilding")).scalar() is not None

"""A store's encryption in the catalog (``store_info``): whether it is encrypted, fixed once
at creation (key ``encryption``), and an encrypted store's key record (key ``key_record``).

The ``encryption`` row is written exclusively, in the transaction that writes the key record
when a key holder creates the store, alone when a keyless process does: of openers racing on a
new store the first row written fixes its encryption for good, and every other opener reads it
back and adopts it or is refused. A key record always means encrypted, whatever the row says
(the writer role may update ``store_info`` values, never remove a row). Catalogs from before
the row get it at their next writable open (:func:`save_state`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from sqlalchemy import select, update

from casckpt.catalog import schema as s
from casckpt.catalog.database import insert_ignore
from casckpt.catalog.encryption import KEY_RECORD as _KEY
from casckpt.catalog.encryption import STATE as _STATE
from casckpt.catalog.encryption import state_in
from casckpt.format.crypto import STATE_PLAIN

if TYPE_CHECKING:
    from casckpt.catalog.catalog import Catalog


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


def read_state(catalog: Catalog) -> str | None:
    """The store's encryption as the catalog fixes it (see :func:`~casckpt.catalog.encryption.state_in`)."""
    with catalog.read() as conn:
        return state_in(conn)


def fix_plain(catalog: Catalog) -> str:
    """Fix the store's encryption as plain unless it is fixed already (a keyless process
    opening a new store, or one from before the row); returns the state kept, which a process
    racing with a key holder may find sealed."""
    with catalog.write() as conn:
        if state_in(conn) is None:
            insert_ignore(conn, s.store_info, [{"key": _STATE, "value": STATE_PLAIN}], "key")
        return state_in(conn) or STATE_PLAIN


def save_state(catalog: Catalog, state: str) -> None:
    """Give a catalog from before the ``encryption`` row the state its key holder unlocked."""
    with catalog.write() as conn:
        insert_ignore(conn, s.store_info, [{"key": _STATE, "value": state}], "key")


def create_key_record(catalog: Catalog, doc: dict[str, Any], state: str) -> str:
    """Fix the store's encryption as ``state`` and record ``doc`` as its key record, in one
    transaction, unless its encryption is fixed already: of processes creating one store at
    once, the first to write wins -- a keyless one too, whose store is then plain. Returns the
    state kept (each caller then unlocks the key record kept, or is refused). The audit trail
    gets a ``key.create`` row when this call's record is the one kept."""
    with catalog.write() as conn:
        if state_in(conn) is None:
            insert_ignore(conn, s.store_info, [{"key": _STATE, "value": state}], "key")
            if state_in(conn) == state:  # this call's row was kept (PostgreSQL: re-read after any wait)
                insert_ignore(conn, s.store_info, [{"key": _KEY, "value": _text(doc)}], "key")
        kept = conn.execute(select(s.store_info.c.value).where(s.store_info.c.key == _KEY)).scalar()
        if kept is not None and json.loads(kept) == doc:
            catalog.audit_in(conn, "key.create", None, {"keys": [slot["id"] for slot in doc["slots"]]})
        return state_in(conn) or state


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

"""A store's encryption in the catalog (``store_info``): whether it is encrypted, fixed once
at creation (key ``encryption``), and an encrypted store's key record (key ``key_record``).

The ``encryption`` row is written exclusively, in the transaction that writes the key record
when a key holder creates the store, alone when a keyless process does: of openers racing on a
new store the first row written fixes its encryption for good, and every other opener reads it
back and adopts it or is refused. A key record always means encrypted, whatever the row says
(the writer role may update ``store_info`` values, never remove a row). Catalogs from before
the row get it at their next writable open (:func:`record_state`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, select, update

from casckpt.catalog import schema as s
from casckpt.catalog.database import insert_ignore
from casckpt.errors import StoreKeyError
from casckpt.format.crypto import STATE_PLAIN, STATE_SEALED

if TYPE_CHECKING:
    from casckpt.catalog.catalog import Catalog

_KEY = "key_record"
_STATE = "encryption"


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


def _state_in(conn: Connection) -> str | None:
    """The store's encryption as the catalog fixes it: ``plain``, ``sealed:FINGERPRINT``
    (:func:`casckpt.format.crypto.encryption_state`), ``sealed`` (a key record whose data key's
    fingerprint is not recorded: a catalog from before the row), or None (not fixed yet: a new
    catalog, or a plain one from before the row)."""
    rows = {key: value for key, value in conn.execute(
        select(s.store_info.c.key, s.store_info.c.value).where(s.store_info.c.key.in_([_STATE, _KEY])))}
    state = rows.get(_STATE)
    if _KEY in rows:  # a key record is never read as "not encrypted"
        return state if state is not None and state.startswith(f"{STATE_SEALED}:") else STATE_SEALED
    return state


def read_state(catalog: Catalog) -> str | None:
    """The store's encryption as the catalog fixes it (see :func:`_state_in`)."""
    with catalog.read() as conn:
        return _state_in(conn)


def fix_plain(catalog: Catalog) -> str:
    """Fix the store's encryption as plain unless it is fixed already (a keyless process
    opening a new store, or one from before the row); returns the state kept, which a process
    racing with a key holder may find sealed."""
    with catalog.write() as conn:
        if _state_in(conn) is None:
            insert_ignore(conn, s.store_info, [{"key": _STATE, "value": STATE_PLAIN}], "key")
        return _state_in(conn) or STATE_PLAIN


def record_state(catalog: Catalog, state: str) -> None:
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
        if _state_in(conn) is None:
            insert_ignore(conn, s.store_info, [{"key": _STATE, "value": state}], "key")
            if _state_in(conn) == state:  # this call's row was kept (PostgreSQL: re-read after any wait)
                insert_ignore(conn, s.store_info, [{"key": _KEY, "value": _text(doc)}], "key")
        kept = conn.execute(select(s.store_info.c.value).where(s.store_info.c.key == _KEY)).scalar()
        if kept is not None and json.loads(kept) == doc:
            catalog.audit_in(conn, "key.create", None, {"keys": [slot["id"] for slot in doc["slots"]]})
        return _state_in(conn) or state


def matches(fixed: str | None, mine: str) -> bool:
    """Whether a process whose crypto's state is ``mine`` may write to a store whose catalog
    fixes ``fixed`` (a catalog not fixed yet is a plain store's: a key holder fixes it at open)."""
    if fixed is None:
        return mine == STATE_PLAIN
    if fixed == STATE_SEALED:
        return mine.startswith(f"{STATE_SEALED}:")
    return fixed == mine


def require_state_in(conn: Connection, mine: str, where: str) -> None:
    """Refuse, inside a writer's transaction, unless the store's encryption is still the one the
    writer opened it with (before a commit's first object, and when it publishes).

    Raises:
        StoreKeyError: they differ; the caller's transaction rolls back.
    """
    fixed = _state_in(conn)
    if not matches(fixed, mine):
        raise StoreKeyError(
            f"the catalog at {where} records this store as {describe(fixed)}, but this process "
            f"opened it as {describe(mine)}: nothing of this write was published. Open the store "
            "again (with its key file if it is encrypted) and retry")


def describe(state: str | None) -> str:
    """A store encryption state (see :func:`_state_in`) in words."""
    if state is None or state == STATE_PLAIN:
        return "not encrypted"
    return "encrypted" if state == STATE_SEALED else f"encrypted (data key {state.partition(':')[2][:12]})"


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

"""A store's encryption state as the catalog fixes it (``store_info``), read and checked inside
a transaction. A leaf: the catalog checks it in every writer's transaction
(:meth:`~casckpt.catalog.catalog.Catalog.require_crypto_in`); :mod:`casckpt.catalog.keys`
fixes it and keeps the key record.
"""

from __future__ import annotations

from sqlalchemy import Connection, select

from casckpt.catalog import schema as s
from casckpt.errors import StoreKeyError
from casckpt.format.crypto import STATE_PLAIN, STATE_SEALED

KEY_RECORD = "key_record"
STATE = "encryption"


def state_in(conn: Connection) -> str | None:
    """The store's encryption as the catalog fixes it: ``plain``, ``sealed:FINGERPRINT``
    (:func:`casckpt.format.crypto.encryption_state`), ``sealed`` (a key record whose data key's
    fingerprint is not recorded: a catalog from before the row), or None (not fixed yet: a new
    catalog, or a plain one from before the row)."""
    rows = {key: value for key, value in conn.execute(
        select(s.store_info.c.key, s.store_info.c.value).where(s.store_info.c.key.in_([STATE, KEY_RECORD])))}
    state = rows.get(STATE)
    if KEY_RECORD in rows:  # a key record is never read as "not encrypted"
        return state if state is not None and state.startswith(f"{STATE_SEALED}:") else STATE_SEALED
    return state


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
    fixed = state_in(conn)
    if not matches(fixed, mine):
        raise StoreKeyError(
            f"the catalog at {where} records this store as {describe(fixed)}, but this process "
            f"opened it as {describe(mine)}: nothing of this write was published. Open the store "
            "again (with its key file if it is encrypted) and retry")


def describe(state: str | None) -> str:
    """A store encryption state (see :func:`state_in`) in words."""
    if state is None or state == STATE_PLAIN:
        return "not encrypted"
    return "encrypted" if state == STATE_SEALED else f"encrypted (data key {state.partition(':')[2][:12]})"

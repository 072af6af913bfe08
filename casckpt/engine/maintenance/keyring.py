"""An encrypted store's keys: unlocking at open, creating, and the master-key operations.

The key record (:class:`~casckpt.format.crypto.KeyRecord`) lives in the catalog
(authoritative) and, unsealed, on every location as ``casckpt-keys`` (so ``catalog
rebuild`` can unlock the store from its locations alone). It holds only wrapped
data keys. Unlocking happens at open, before any object but the identity and key
records is read or written: a missing or wrong key is refused there.

- A catalog with a key record: unlocked with the key given.
- An empty catalog (new, or recovering) without one, over locations that carry one:
  a catalog rebuild (``recover=True``) adopts it; anything else is refused. A catalog
  holding versions answers alone (no location is read): one that lost its record
  row is refused when it recorded the store as encrypted; one from before that
  record (:mod:`casckpt.catalog.keys`) opens as a plain store, whose every read of a
  sealed object fails as damaged.
- Neither: with a key, a new store is created encrypted (a store holding data
  already is refused: it cannot be encrypted in place); without, a plain store.

Whether a store is encrypted is fixed once, in the catalog, by the transaction that
creates its key record -- or, opened without a key, by one that records it plain --
and only the first of processes creating one store at once fixes it: the others
read it back, and adopt it or are refused (a keyless process ``KeyRequiredError``,
a holder of another key ``WrongKeyError``, a key holder after a keyless creator
``NotEncryptedError``), before any object is written. Every writer checks it again
when it begins writing objects and when it publishes
(:func:`casckpt.catalog.encryption.require_state_in`).

Master-key changes (:func:`add_key`, :func:`remove_key`, :func:`rotate_key`)
rewrite the record only: the data key, and so every object, stays as it is.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from casckpt.catalog import Catalog, encryption
from casckpt.catalog import keys as keys_sql
from casckpt.catalog import shards as shard_sql
from casckpt.catalog.audit import who as audit_who
from casckpt.errors import (
    BlobNotFoundError,
    CasckptError,
    InvalidArgumentError,
    LastKeyError,
    NotEncryptedError,
    ReadOnlyStoreError,
    StorageError,
    StoreIdentityError,
    StoreKeyError,
)
from casckpt.format import crypto, objectnames
from casckpt.format.crypto import STATE_PLAIN, STATE_SEALED, KeyRecord, StoreCrypto
from casckpt.storage import BlobStore
from casckpt.storage.locations import LocationSet
from casckpt.storage.sealed import CLEAR_NAMES

log = logging.getLogger(__name__)

_MAX_RECORD = 1 << 20
_MAX_KEY_FILE = 4096  # a key file is one line of about 60 bytes


def who() -> str:
    """``user@host`` of this process (for key slots; the audit trail records the same)."""
    me = audit_who()
    return f"{me.os_user}@{me.host}"


def read_key_file(path: str | os.PathLike[str]) -> bytes:
    """The master key in a key file (a warning when others may read it).

    Only a regular file is read, and only its first :data:`_MAX_KEY_FILE` bytes: a FIFO
    or a device (``/dev/zero``) is refused at once rather than blocking or reading
    without end.

    Raises:
        StoreKeyError: the file cannot be read, is not a regular file, or is not a key file.
    """
    where = Path(path).expanduser()
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block the open
    except OSError as exc:
        raise StoreKeyError(f"cannot read the key file {where}: {exc.strerror or exc}; "
                            "check the path (`casckpt key generate FILE` makes one)") from None
    try:
        mode = os.fstat(fd).st_mode
        data = _read_regular(fd, mode)
    except OSError as exc:
        raise StoreKeyError(f"cannot read the key file {where}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if data is None:
        raise StoreKeyError(f"the key file {where} is not a regular file; give the path of the "
                            "file `casckpt key generate` wrote")
    if len(data) > _MAX_KEY_FILE:
        raise StoreKeyError(f"{where} is over {_MAX_KEY_FILE} bytes, so it is not a casckpt key file "
                            "(one is a single line); check the path")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise StoreKeyError(f"{where} is not a casckpt key file (it is not ASCII text); "
                            "check the path") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the key file %s may be read by other users (mode %o): `chmod 600 %s`",
                    where, stat.S_IMODE(mode), where)
    return crypto.parse_key_file(text, str(where))


def _read_regular(fd: int, mode: int) -> bytes | None:
    """Up to ``_MAX_KEY_FILE + 1`` bytes of the open file ``fd`` (None: not a regular file)."""
    if not stat.S_ISREG(mode):
        return None
    with os.fdopen(os.dup(fd), "rb") as f:
        return f.read(_MAX_KEY_FILE + 1)


def write_key_file(path: str | os.PathLike[str], key: bytes) -> Path:
    """Write a new key file holding ``key``, mode 0600, refusing to overwrite one.

    Raises:
        StoreKeyError: the file exists or cannot be written.
    """
    where = Path(path).expanduser()
    try:
        fd = os.open(where, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise StoreKeyError(f"{where} exists already: a key file is never overwritten (a lost key "
                            "loses the store); choose another path") from None
    except OSError as exc:
        raise StoreKeyError(f"cannot create the key file {where}: {exc}") from exc
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, crypto.key_file_text(key).encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    return where


def catalog_record(catalog: Catalog) -> KeyRecord | None:
    """The key record the catalog holds (None: the store is not encrypted).

    Raises:
        StoreKeyError: the catalog's record is damaged.
    """
    try:
        doc = keys_sql.read_key_record(catalog)
    except ValueError as exc:
        raise StoreKeyError(f"the key record in the catalog at {catalog.where} is damaged: {exc}") from exc
    return None if doc is None else KeyRecord.from_json(doc, f"in the catalog at {catalog.where}")


def location_record(name: str, blobs: BlobStore) -> KeyRecord | None:
    """The key record a location carries (None: none, or the location cannot be read)."""
    try:
        data = blobs.get(objectnames.KEYS_RECORD, max_size=_MAX_RECORD)
    except BlobNotFoundError:
        return None
    except StorageError as exc:  # an unreachable location: its identity survey says so
        log.debug("cannot read the key record of blob location %s: %s", name, exc)
        return None
    try:
        return KeyRecord.from_json(json.loads(data), f"on blob location {name}")
    except (ValueError, StoreKeyError) as exc:
        log.warning("the key record on blob location %s is damaged (%s); `casckpt key list` "
                    "writes it again from the catalog", name, exc)
        return None


def _holds_sealed(blobs: BlobStore) -> bool:
    """Whether the first manifest (else pack object) on ``blobs`` is sealed (False: none, or
    the location cannot be read)."""
    try:
        for prefix in (objectnames.MANIFESTS, objectnames.PACKS):
            for info in blobs.list(prefix):
                return blobs.get_range(info.key, 0, len(crypto.SEAL_MAGIC)) == crypto.SEAL_MAGIC
    except StorageError as exc:
        log.debug("cannot look for sealed objects: %s", exc)
    return False


def unlock(catalog: Catalog, opened: Mapping[str, BlobStore], master: bytes | None, *,
           recover: bool = False, read_only: bool = False) -> StoreCrypto:
    """Decide the store's encryption at open (see the module docstring), creating it for a new
    store opened with a key, and fixing a new store opened without one as plain. Sets
    ``catalog.crypto``.

    Raises:
        KeyRequiredError, WrongKeyError: the store is encrypted; no key, or not one of its keys
            (a key holder that lost the race to create the store to a holder of another key).
        NotEncryptedError: a key was given for a store that exists unencrypted (a keyless
            process created it first, included).
        StoreIdentityError: the locations are encrypted and the catalog has no key record.
        StoreKeyError: a new or recovering catalog over encrypted objects whose key record
            is on no location, or a catalog that records the store as encrypted but lost its
            key record or holds another data key's (never opened as a plain store: its commits
            would be plaintext).
    """
    record = catalog_record(catalog)
    if record is None and (recover or master is not None or shard_sql.is_empty(catalog)):
        # a new or recovering catalog, or a key given: are the locations an encrypted store's? (a
        # catalog holding versions opened without a key answers alone: no location is read)
        found = [r for r in (location_record(n, b) for n, b in opened.items()) if r is not None]
        if found and not recover:
            # read again before refusing for its absence: an opener racing this one may have
            # created the store since (its record is committed before its first object)
            record = catalog_record(catalog)
            if record is None:
                if master is None:
                    crypto.unlock(found[0], None)  # raises KeyRequiredError
                raise StoreIdentityError(
                    f"the blob locations hold an encrypted store (id {found[0].store_id}) but the "
                    f"catalog at {catalog.where} records no key for it: it is not this store's "
                    "catalog, or it lost its key record. Rebuild the catalog from the locations "
                    "(`casckpt --key-file FILE catalog rebuild`) into a new, empty catalog")
        elif found:
            store, kept = _unlock_any(found, master)
            if not read_only:
                keys_sql.create_key_record(catalog, kept.to_json(), store.state)
            return _adopt(catalog, store, read_only)
        elif recover or shard_sql.is_empty(catalog):
            sealed_on = next((n for n, b in opened.items() if _holds_sealed(b)), None)
            record = None if sealed_on is None else catalog_record(catalog)  # read again
            if sealed_on is not None and record is None:  # never a plain catalog over sealed objects
                raise StoreKeyError(
                    f"blob location {sealed_on} holds encrypted objects but no location has a "
                    f"readable key record ({objectnames.KEYS_RECORD}), and the catalog at "
                    f"{catalog.where} has none: the store's data key is wrapped only there. Put "
                    f"back a copy of {objectnames.KEYS_RECORD} (a bucket version, a backup, "
                    "another location) or open the catalog that holds the record; nothing was "
                    "written")
    if record is None and master is None:
        return _open_plain(catalog, read_only)
    if record is None and master is not None:
        fixed = keys_sql.read_state(catalog)
        if fixed is None and shard_sql.is_empty(catalog) and not any(
                info.key not in CLEAR_NAMES for b in opened.values() for info in b.list()):
            if read_only:
                raise ReadOnlyStoreError("creating an encrypted store needs write access to the "
                                         "catalog; it was opened read-only", right="catalog:write")
            record = _create(catalog, master)
        else:
            record = catalog_record(catalog)  # read again
            if record is None and fixed is not None and fixed != STATE_PLAIN:
                raise _lost_record(catalog)
            if record is None:
                raise _not_encrypted()
    return _adopt(catalog, crypto.unlock(record, master), read_only)


def _open_plain(catalog: Catalog, read_only: bool) -> StoreCrypto:
    """A store opened without a key: plain if its catalog says so, or says nothing yet (then
    fixed as plain here, unless read-only: a read-only process writes no object either).

    Raises:
        KeyRequiredError: a key holder fixed it as encrypted (first, when both created it at once).
        StoreKeyError: it is encrypted but its catalog lost the key record.
    """
    fixed = keys_sql.read_state(catalog)
    if fixed is None and not read_only:
        fixed = keys_sql.fix_plain(catalog)
    if fixed is None or fixed == STATE_PLAIN:
        return crypto.PLAIN
    record = catalog_record(catalog)
    if record is None:
        raise _lost_record(catalog)
    return crypto.unlock(record, None)  # raises KeyRequiredError


def _adopt(catalog: Catalog, store: StoreCrypto, read_only: bool) -> StoreCrypto:
    """Make ``store`` (unlocked from the catalog's key record) the catalog's crypto once it is
    the encryption the catalog fixed; a catalog from before the ``encryption`` row gets it.

    Raises:
        StoreKeyError: the catalog fixed another encryption (the key record was replaced by
            one wrapping another data key, or the store was fixed as plain).
    """
    fixed = keys_sql.read_state(catalog)
    if fixed == STATE_SEALED and not read_only:
        keys_sql.save_state(catalog, store.state)
    elif fixed is not None and not encryption.matches(fixed, store.state):
        raise StoreKeyError(
            f"the catalog at {catalog.where} records this store as {encryption.describe(fixed)}, but "
            f"its key record unlocks another data key ({encryption.describe(store.state)}): the "
            "record was replaced. Restore the catalog from a backup, or rebuild it from the "
            "locations (`casckpt --key-file FILE catalog rebuild`) into a new, empty catalog; "
            "nothing was written")
    catalog.crypto = store
    return store


def _not_encrypted() -> NotEncryptedError:
    return NotEncryptedError(
        "this store exists and is not encrypted (or a process without a key created it first, "
        "at the same moment); a store is encrypted when it is created (an existing one cannot "
        "be encrypted in place): create a new store with the key and copy the versions you need "
        "into it (`casckpt export` / `casckpt import`), or open this one without a key")


def _lost_record(catalog: Catalog) -> StoreKeyError:
    return StoreKeyError(
        f"the catalog at {catalog.where} records this store as encrypted but has lost its key "
        "record; it is never opened as a plain store (its commits would be plaintext). Rebuild "
        "the catalog from the locations, which carry the record (`casckpt --key-file FILE "
        "catalog rebuild`), into a new, empty catalog; nothing was written")


def _unlock_any(found: list[KeyRecord], master: bytes | None) -> tuple[StoreCrypto, KeyRecord]:
    """Unlock with the first of the locations' key records (the one most locations hold first)
    that ``master`` opens. Locations can disagree: one unreachable while a key was rotated or
    removed keeps the record from before, which the new key does not open (and the old key
    may be destroyed by then).

    Raises:
        KeyRequiredError, WrongKeyError: of the most common record, when none opens.
    """
    distinct = sorted(dict.fromkeys(found), key=found.count, reverse=True)  # ties: the locations' order
    if len(distinct) > 1:
        log.warning("the blob locations hold %d different key records (one was unreachable "
                    "while the keys changed?); using the one the key given opens", len(distinct))
    try:
        return crypto.unlock(distinct[0], master), distinct[0]
    except CasckptError as first:  # KeyRequiredError, WrongKeyError: the most common record's is raised
        for record in distinct[1:]:
            try:
                return crypto.unlock(record, master), record
            except CasckptError:
                continue
        raise first from None


def _create(catalog: Catalog, master: bytes) -> KeyRecord:
    """Create the store's key record, fixing it as encrypted in the same transaction; of
    processes creating one store at once the first to fix its encryption wins, and each then
    unlocks the record kept (a holder of another key: WrongKeyError).

    Raises:
        NotEncryptedError: a process without a key fixed the store as plain first.
    """
    data_key = os.urandom(crypto.KEY_BYTES)
    record = KeyRecord(catalog.store_id, (crypto.wrap(data_key, master, catalog.store_id, who()),))
    kept_state = keys_sql.create_key_record(catalog, record.to_json(), crypto.encryption_state(data_key))
    if kept_state == STATE_PLAIN:
        raise _not_encrypted()
    kept = catalog_record(catalog)
    if kept is None:
        raise _lost_record(catalog)
    if kept == record:
        log.info("created the key record of encrypted store %s (key %s)", catalog.store_id,
                 record.slots[0].id)
    return kept


def publish(catalog: Catalog, blobs: Mapping[str, BlobStore]) -> None:
    """Write the catalog's key record to each of ``blobs`` (by location name) that lacks it or
    holds another (failures logged: the catalog's copy is authoritative)."""
    record = catalog_record(catalog)
    if record is None:
        return
    data = json.dumps(record.to_json(), sort_keys=True).encode()
    for name, store in blobs.items():
        if location_record(name, store) == record:
            continue
        try:
            store.put(objectnames.KEYS_RECORD, data)
        except CasckptError as exc:
            log.warning("could not write the key record to blob location %s: %s", name, exc)


def _change(catalog: Catalog, locations: LocationSet, old: KeyRecord, new: KeyRecord, action: str,
            **detail: str) -> None:
    if not keys_sql.replace_key_record(catalog, old.to_json(), new.to_json(), action, detail):
        raise StoreKeyError("the store's keys changed while this change was made (another `casckpt "
                            "key` command?); nothing was changed: run it again")
    publish(catalog, {loc.name: loc.blobs for loc in locations.all if loc.readable})


def _require(catalog: Catalog) -> KeyRecord:
    record = catalog_record(catalog)
    if record is None:
        raise NotEncryptedError("this store is not encrypted: it has no keys (create an encrypted "
                                "store with `casckpt init PATH --encrypt --key-file FILE`)")
    return record


def _new_slot(record: KeyRecord, opened: StoreCrypto, master: bytes) -> crypto.KeySlot:
    """A slot wrapping the data key for ``master``, refused when ``master`` is one of the keys already."""
    if record.slot(crypto.key_id(master)) is not None:
        raise InvalidArgumentError(f"key {crypto.key_id(master)} is one of this store's keys already")
    return opened.wrap_for(master, record.store_id, who())


def key_slots(catalog: Catalog) -> tuple[crypto.KeySlot, ...]:
    """The store's master-key slots (ids, when and by whom each was added)."""
    return _require(catalog).slots


def add_key(catalog: Catalog, locations: LocationSet, opened: StoreCrypto, master: bytes) -> crypto.KeySlot:
    """Let ``master`` open the store too (a new slot wrapping the same data key).

    Raises:
        InvalidArgumentError: ``master`` is one of the store's keys already.
    """
    record = _require(catalog)
    slot = _new_slot(record, opened, master)
    _change(catalog, locations, record, replace(record, slots=(*record.slots, slot)), "key.add",
            key_id=slot.id)
    return slot


def remove_key(catalog: Catalog, locations: LocationSet, kid: str) -> None:
    """Remove the slot of master key ``kid``; the last one is never removed.

    Raises:
        LastKeyError: it is the store's only key.
        InvalidArgumentError: no key has that id.
    """
    record = _require(catalog)
    if record.slot(kid) is None:
        raise InvalidArgumentError(
            f"this store has no key {kid!r}; its keys: {', '.join(s.id for s in record.slots)}")
    if len(record.slots) == 1:
        raise LastKeyError(f"key {kid} is this store's only key: removing it would make every version "
                           "unreadable. Add another key first (`casckpt key add FILE`)")
    _change(catalog, locations, record, replace(record, slots=tuple(s for s in record.slots if s.id != kid)),
            "key.remove", key_id=kid)


def rotate_key(catalog: Catalog, locations: LocationSet, opened: StoreCrypto, old: str,
               master: bytes) -> crypto.KeySlot:
    """Replace master key ``old`` by ``master`` in one change of the record (no data rewritten).

    Raises:
        InvalidArgumentError: ``old`` is not a key of the store, or ``master`` is one already.
    """
    record = _require(catalog)
    if record.slot(old) is None:
        raise InvalidArgumentError(f"this store has no key {old!r}")
    slot = _new_slot(record, opened, master)
    _change(catalog, locations, record,
            replace(record, slots=(*(s for s in record.slots if s.id != old), slot)), "key.rotate",
            key_id=slot.id, previous=old)
    return slot

"""The catalog-loss interlock: a catalog is trusted with a location only when both name one store.

Every location carries an identity record (:mod:`casckpt.format.identity`);
the catalog records the same store id and generation. Opening a store
surveys each location it can reach:

- record of this store and generation: nothing to do;
- record of this store, older generation (the location missed a rebuild):
  rewritten;
- record of this store, *newer* generation: the catalog is from before a
  rebuild (restored from an old backup) -- refused;
- record of another store: the catalog is new, emptied, or another store's
  -- refused, naming both stores and ``casckpt catalog rebuild``;
- record of this store written for another of its locations: one storage is
  configured under two names (a second spelling of its URL, a bind mount)
  -- refused: gc would take each name's objects for the other's stale copies;
- no record (or a damaged one) on a location holding no data: written
  (a new store, a new location);
- no record (or a damaged one) on a location holding data: the store was
  made by a casckpt without identity records, or its catalog was lost. The
  record is written only if the catalog is not empty and already knows
  some of the location's objects; otherwise refused.

``recover=True`` (for ``catalog rebuild``) accepts an empty catalog over
existing data and writes nothing: the rebuild adopts the locations'
identity. GC repeats a strict check (:func:`require_match`) before it deletes
anything: every location it lists must carry this catalog's exact identity.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

from casckpt.catalog import Catalog
from casckpt.catalog import identity as identity_sql
from casckpt.catalog import shards as shard_sql
from casckpt.catalog.gc import known_manifests
from casckpt.errors import BlobNotFoundError, GCRefusedError, StorageError, StoreIdentityError
from casckpt.format import objectnames
from casckpt.format.identity import (
    IDENTITY_NAME,
    MAX_IDENTITY_BYTES,
    CorruptIdentityError,
    StoreIdentity,
    decode_identity,
    encode_identity,
)
from casckpt.storage import BlobStore, redact_url
from casckpt.storage.locations import LocationSet

log = logging.getLogger(__name__)

_SAMPLE = 64  # objects of an unmarked location checked against the catalog before adopting it


@dataclass(frozen=True, slots=True)
class Survey:
    """What one location says about its owner.

    ``record`` is None when the location has none; ``damaged`` says why a
    record could not be used; ``unreachable`` why the location could not
    be read at all (nothing is decided about it then).
    """

    name: str
    url: str
    blobs: BlobStore
    record: StoreIdentity | None = None
    damaged: str | None = None
    unreachable: str | None = None


def read_record(blobs: BlobStore) -> StoreIdentity | None:
    """The location's identity record (None: it has none).

    Raises:
        CorruptIdentityError: the record is damaged.
        StorageError: the location cannot be read.
    """
    try:
        data = blobs.get(IDENTITY_NAME, max_size=MAX_IDENTITY_BYTES)
    except BlobNotFoundError:
        return None
    return decode_identity(data, f"{redact_url(blobs.url)}/{IDENTITY_NAME}")


def write_record(blobs: BlobStore, identity: StoreIdentity, location: str) -> None:
    """Write (or overwrite) the identity record of the location named ``location``.

    Raises:
        StorageError: the location refused it.
    """
    blobs.put(IDENTITY_NAME, encode_identity(identity.at(location)))


def survey(name: str, blobs: BlobStore) -> Survey:
    """Read one location's identity record.

    Raises:
        AccessDeniedError: the read was refused. It is not recorded as ``unreachable``, and
            neither is a refused listing taken for data (:func:`check_at_open`): opening
            stops, naming the right and the policy statement that grants it.
    """
    try:
        return Survey(name, blobs.url, blobs, record=read_record(blobs))
    except CorruptIdentityError as exc:
        return Survey(name, blobs.url, blobs, damaged=str(exc))
    except StorageError as exc:
        return Survey(name, blobs.url, blobs, unreachable=str(exc))


def _sample(blobs: BlobStore, prefix: str) -> list[str]:
    return list(islice((info.key for info in blobs.list(prefix)), _SAMPLE))


def _refusal(catalog: Catalog, mine: StoreIdentity, loc: Survey, what: str) -> StoreIdentityError:
    return StoreIdentityError(
        f"blob location {loc.name} ({redact_url(loc.url)}) {what}, but the catalog at "
        f"{catalog.where} is {mine.describe()}: the catalog is new, emptied, stale or another "
        "store's, and trusting it could delete this store's checkpoints. Nothing was changed. If "
        "the catalog was lost, rebuild it from the locations into a new, empty catalog: "
        "`casckpt --store PATH catalog rebuild`. If the store's config names the wrong catalog, "
        "fix casckpt.toml.")


def _alias(loc: Survey, record: StoreIdentity) -> StoreIdentityError:
    return StoreIdentityError(
        f"blob location {loc.name} ({redact_url(loc.url)}) holds the identity record of this store's "
        f"location {record.location!r}: it is the same storage under two names (another spelling "
        "of its URL, a bind mount, an NFS path). Nothing was changed; keep one of the two names "
        "(fix casckpt.toml, or do not add it again). Were both kept, gc would take each name's "
        "objects for stale copies of the other's")


def _adoptable(catalog: Catalog, loc: Survey, empty: bool) -> bool | None:
    """For a location without a usable record: None if it holds no data; else whether the
    catalog (``empty``: it has no data) already knows some of its objects (then it is this
    store's, from before records)."""
    try:
        manifests = _sample(loc.blobs, objectnames.MANIFESTS)
        packs = [] if manifests else _sample(loc.blobs, objectnames.PACKS)
    except StorageError as exc:
        log.warning("cannot list blob location %s to check whose data it holds: %s", loc.name, exc)
        return False
    if not manifests and not packs:
        return None
    if empty:
        return False
    if manifests:
        return bool(known_manifests(catalog, [k.removeprefix(objectnames.MANIFESTS) for k in manifests]))
    return bool(shard_sql.keys_on_location(catalog, loc.name, packs))


def check_at_open(catalog: Catalog, surveys: Sequence[Survey], *, recover: bool) -> list[Survey]:
    """Decide, for every surveyed location, whether this catalog may be trusted with it.

    Returns the locations whose record must be (re)written. With ``recover``
    and an empty catalog, nothing is refused and nothing is to be written.

    Raises:
        StoreIdentityError: some location is not this catalog's store (see the module docstring).
    """
    mine = identity_sql.read(catalog)
    empty = shard_sql.is_empty(catalog)
    if recover and empty:
        return []
    to_write = []
    for loc in surveys:
        if loc.unreachable is not None:
            log.warning("cannot read the identity record of blob location %s: %s", loc.name, loc.unreachable)
            continue
        record = loc.record
        if record is not None and record.store_id != mine.store_id:
            raise _refusal(catalog, mine, loc, f"belongs to {record.describe()}")
        if record is not None and record.generation > mine.generation:
            raise _refusal(catalog, mine, loc, f"was taken over by a catalog rebuild ({record.describe()})")
        if record is not None and record.location != loc.name:
            raise _alias(loc, record)
        if record is not None:
            if record.generation < mine.generation:
                to_write.append(loc)
            continue
        held = _adoptable(catalog, loc, empty)
        if held is False:
            what = ("holds checkpoint data but no identity record" if loc.damaged is None
                    else f"holds checkpoint data and a damaged identity record ({loc.damaged})")
            raise _refusal(catalog, mine, loc, what + " the catalog knows nothing of")
        to_write.append(loc)
    return to_write


def write_records(catalog: Catalog, surveys: Sequence[Survey]) -> None:
    """Write this catalog's identity to the given locations, each naming its location, then
    read them back (failures to write are logged: GC refuses to delete on a location without
    the record, so nothing is at risk).

    Raises:
        StoreIdentityError: two of them are one storage (a record reads back another's name).
    """
    if not surveys:
        return
    mine = identity_sql.read(catalog)
    for loc in surveys:
        try:
            write_record(loc.blobs, mine, loc.name)
        except StorageError as exc:
            log.warning("could not write the identity record of blob location %s: %s", loc.name, exc)
    for loc in surveys:
        back = survey(loc.name, loc.blobs).record
        if back is not None and back.location != loc.name:
            raise _alias(loc, back)


def require_match(catalog: Catalog, locations: LocationSet) -> StoreIdentity:
    """Before deleting: every readable location carries exactly this catalog's identity.

    Raises:
        GCRefusedError: some location does not (names it and what to do).
        StorageError: a location cannot be read.
    """
    mine = identity_sql.read(catalog)
    for loc in locations.all:
        if not loc.readable:
            continue
        try:
            record = read_record(loc.blobs)
        except CorruptIdentityError as exc:
            record, why = None, str(exc)
        else:
            why = "it has no identity record"
        if record is not None and mine.same_as(record) and record.location != loc.name:
            why = (f"its record was written for location {record.location!r}: the same storage "
                   "under two names")
            record = None
        if not mine.same_as(record):
            if record is not None:
                why = f"it carries {record.describe()}"
            raise GCRefusedError(
                f"gc deletes nothing: blob location {loc.describe()} does not prove it belongs to "
                f"this catalog's {mine.describe()} ({why}). Open the store once with its "
                "catalog (any casckpt command) to write the record, or run `casckpt check` to "
                "find out whose data it holds.")
    return mine

"""The store identity record every blob location carries.

A small JSON object under the object name :data:`IDENTITY_NAME` of each location:

    {"format": "casckpt.identity", "version": 1, "store_id": "<32 hex>",
     "created_at": <epoch seconds>, "generation": <int >= 1>, "location": "<its name>",
     "checksum": "<BLAKE3 (object context) of the canonical JSON of the other fields>"}

The catalog records the same three values. ``generation`` counts catalog
rebuilds: a rebuild raises it on the catalog and on every location, so a
catalog restored from before the rebuild (a lower generation) is refused.
Opening, gc and rebuild compare the two sides before trusting the catalog
with anything on a location (see :mod:`casckpt.engine.locations.identity`). The record
also names the location it was written for, so one storage configured under
two names (a second spelling of a URL, a bind mount, an NFS path) is found
out: reading it as the other location gives the wrong name.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from casckpt.errors import IntegrityError
from casckpt.format import objectnames
from casckpt.format.chunks import object_id

IDENTITY_NAME = objectnames.IDENTITY
IDENTITY_FORMAT = "casckpt.identity"
IDENTITY_VERSION = 1
MAX_IDENTITY_BYTES = 4096  # a record is ~250 bytes; anything larger is not one

_STORE_ID = re.compile(r"^[0-9a-f]{32}$")


class CorruptIdentityError(IntegrityError):
    """A location's identity record cannot be decoded or fails its checksum."""


@dataclass(frozen=True, slots=True)
class StoreIdentity:
    """Who a catalog or location belongs to.

    Attributes:
        store_id: the store's uuid (32 hex digits), fixed at creation.
        created_at: when the store was created (epoch seconds).
        generation: 1 at creation, raised by every catalog rebuild.
        location: in a location's record, the name of the location it was written
            for (None for the catalog's side).
    """

    store_id: str
    created_at: float
    generation: int
    location: str | None = None

    def describe(self) -> str:
        """``store <id> (generation N)`` for messages."""
        return f"store {self.store_id} (generation {self.generation})"

    def at(self, location: str) -> StoreIdentity:
        """This identity as the record of the named location."""
        return StoreIdentity(self.store_id, self.created_at, self.generation, location)

    def same_as(self, other: StoreIdentity | None) -> bool:
        """Whether ``other`` names this store in this catalog generation (creation times are
        informative only: a catalog migrated from before identity records dates its store by
        its first version)."""
        return other is not None and (other.store_id, other.generation) == (self.store_id, self.generation)


def _body(identity: StoreIdentity) -> dict[str, Any]:
    return {"format": IDENTITY_FORMAT, "version": IDENTITY_VERSION, "store_id": identity.store_id,
            "created_at": identity.created_at, "generation": identity.generation,
            "location": identity.location}


def _checksum(body: dict[str, Any]) -> str:
    return object_id(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def encode_identity(identity: StoreIdentity) -> bytes:
    """The record's bytes (deterministic: every writer of one identity writes the same bytes)."""
    body = _body(identity)
    return json.dumps({**body, "checksum": _checksum(body)}, sort_keys=True).encode() + b"\n"


def decode_identity(data: bytes, where: str) -> StoreIdentity:
    """Parse and verify a record read from ``where`` (named in errors).

    Raises:
        CorruptIdentityError: not a record of this format, or its checksum fails.
    """
    def bad(why: str) -> CorruptIdentityError:
        return CorruptIdentityError(
            f"the store identity record at {where} is damaged ({why}); `casckpt check` reports "
            "it and opening the store with its catalog rewrites it once the catalog proves "
            "the location is the store's")

    if len(data) > MAX_IDENTITY_BYTES:
        raise bad(f"{len(data)} bytes, more than a record can be")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        raise bad("not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != IDENTITY_FORMAT:
        raise bad("not a casckpt identity record")
    if doc.get("version") != IDENTITY_VERSION:
        raise bad(f"record version {doc.get('version')!r}; this casckpt reads {IDENTITY_VERSION}")
    store_id, created, generation = doc.get("store_id"), doc.get("created_at"), doc.get("generation")
    location = doc.get("location")
    if not isinstance(store_id, str) or not _STORE_ID.match(store_id):
        raise bad("no valid store id")
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
        raise bad("no valid creation time")
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 1:
        raise bad("no valid generation")
    if not isinstance(location, str) or not 0 < len(location) <= 128:
        raise bad("no valid location name")
    identity = StoreIdentity(store_id, float(created), generation, location)
    if doc.get("checksum") != _checksum(_body(identity)) or set(doc) != {*_body(identity), "checksum"}:
        raise bad("checksum mismatch")
    return identity

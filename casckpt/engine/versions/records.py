"""Small records of the catalog's mutable state, kept on every blob location.

Manifests and packs describe themselves, so ``catalog rebuild`` recovers
versions, lineage, metrics and commit-time tags from them alone. What
changes after a commit -- a tag moved, a run forked, a run's retention,
redundancy or delta chain and policy, the store's policies, the locations and
their states, the definitions of the store's mirrors -- is mirrored here as JSON objects:

    refs/tags/<name key>   {"name", "version"}
    refs/runs/<name key>   {"name", "created_at", "parent_version", "retention", "redundancy",
                            "delta_chain", "delta_policy"}
    refs/store             {"redundancy", "delta_chain", "delta_policy"}
    refs/locations         {"locations": [{"name", "url", "domain", "state"}, ...]}
    refs/mirrors/<name key> {"name", "destination", "key_file", "selection", "propagate_deletions",
                            "created_at"}

plus, in each, ``seq`` (a counter the catalog raises with every record it
writes, so the newest record of a key wins by counter, never by clock
alone) and ``at`` (when). A name key is the name's UTF-8 in hex, or for a
name too long for a file name, ``h`` and its BLAKE3; in an encrypted store, ``k`` and a
keyed hash, so no name shows in an object name (and every record is sealed, see
:mod:`casckpt.storage.sealed`). The store's identity
(id, generation) is the identity record (:mod:`casckpt.format.identity`).

A mirror's record holds its definition, what ``casckpt mirror add`` was told, never what its
runs did (``mirror_versions``, the last run, the destination's identity: a rebuild loses
those). No secret goes into it: the destination is a store's directory (credentials live in
that store's casckpt.toml, never in the mirror; the directory is written redacted all the
same, as is the key file's path; a rebuild skips a record so redacted, saying so), and
``key_file`` is the path of the destination's key file, not the key -- what the catalog
holds too. The record is removed from every location with the mirror.

Records are written after the catalog change succeeds (the catalog stays
authoritative); a failed write is logged, not raised: ``check`` reports a
record missing or stale on a location and ``repair`` writes it again.
:func:`expected` says which records the catalog implies now.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from casckpt.catalog import mirrors as mirror_sql
from casckpt.catalog import shards as shard_sql
from casckpt.catalog.deltas import DELTA_POLICIES
from casckpt.catalog.history import RunSettings, run_settings, tags_and_runs
from casckpt.catalog.identity import next_record_seq
from casckpt.catalog.settings import DELTA_CHAIN, DELTA_POLICY, REDUNDANCY
from casckpt.errors import (
    AccessDeniedError,
    BlobNotFoundError,
    CasckptError,
    OversizedObjectError,
    StorageError,
    UnsafeObjectError,
)
from casckpt.format import objectnames
from casckpt.format.state import json_nesting
from casckpt.storage import redact_url
from casckpt.storage.locations import Location, LocationSet

log = logging.getLogger(__name__)

TAGS = objectnames.TAGS
RUNS = objectnames.RUNS
STORE = objectnames.STORE_RECORD
LOCATIONS = objectnames.LOCATIONS_RECORD
MIRRORS = objectnames.MIRRORS
REDACTED = "***"  # what redact_url puts in place of what looks like a credential
MAX_RECORD = 1 << 20  # a record is a few hundred bytes; anything near this is not one
_MAX_NESTING = 64  # a retention policy is the deepest thing a record holds: 3 levels

_HEX_ID = re.compile(r"^[0-9a-f]{64}$")


def _encode(catalog: Any, doc: dict[str, Any]) -> bytes:
    return json.dumps({**doc, "seq": next_record_seq(catalog), "at": time.time()}, sort_keys=True).encode()


def _put(locations: LocationSet, catalog: Any, key: str, doc: dict[str, Any]) -> None:
    try:
        locations.put_everywhere(key, _encode(catalog, doc))
    except CasckptError as exc:
        log.warning("could not record %s on the blob locations (%s); `casckpt check` reports it "
                    "and `casckpt repair` writes it again", key, exc)


def write_to(location: Location, catalog: Any, key: str, doc: dict[str, Any]) -> None:
    """Write one record to one location (``repair``).

    Raises:
        StorageError: the location refused it.
    """
    location.blobs.put(key, _encode(catalog, doc))


def record_tag(locations: LocationSet, catalog: Any, name: str, version_id: str) -> None:
    """Mirror tag ``name`` -> ``version_id``."""
    _put(locations, catalog, objectnames.ref_name(TAGS, name, catalog.crypto.name_hash),
         {"name": name, "version": version_id})


def tag_lacking(locations: LocationSet, catalog: Any, name: str, version_id: str,
                down: set[str]) -> list[Location]:
    """The active locations whose record of tag ``name`` is missing or names another version
    than ``version_id``: one small read per location, where ``check`` lists them all (a copy
    asks it of the tags it carries, to write again a record a process killed after its
    publish left unwritten). A location named in ``down`` is not asked; one that cannot
    answer (unreachable: not a missing or unreadable record) is added to it, so a caller
    asking of many tags with a location down neither rewrites every record nor warns for
    each."""
    key = objectnames.ref_name(TAGS, name, catalog.crypto.name_hash)
    want = {"name": name, "version": version_id}
    lacking = []
    for loc in locations.active():
        if loc.name in down:
            continue
        try:
            doc = parse(loc.blobs.get(key, max_size=MAX_RECORD))
        except (BlobNotFoundError, OversizedObjectError, UnsafeObjectError, ValueError, RecursionError):
            lacking.append(loc)  # missing, unreadable or refused as not a record
            continue
        except StorageError:
            down.add(loc.name)
            continue
        if not agrees(key, doc, want):
            lacking.append(loc)
    return lacking


def record_tag_on(targets: Iterable[Location], catalog: Any, name: str, version_id: str,
                  down: set[str]) -> None:
    """Mirror tag ``name`` -> ``version_id`` on each of ``targets`` but those in ``down``; one
    that refuses it is added to ``down`` (the caller warns once for all of them)."""
    key = objectnames.ref_name(TAGS, name, catalog.crypto.name_hash)
    data = _encode(catalog, {"name": name, "version": version_id})
    for loc in targets:
        if loc.name in down:
            continue
        try:
            loc.blobs.put(key, data)
        except CasckptError:
            down.add(loc.name)


def drop_tag(locations: LocationSet, catalog: Any, name: str) -> bool:
    """Remove tag ``name``'s record from every readable location (a copy whose publish failed
    recorded it before; the catalog has no such tag). False: a location refused (logged)."""
    key = objectnames.ref_name(TAGS, name, catalog.crypto.name_hash)
    readable = [(loc.id, key) for loc in locations.all if loc.readable]
    return len(locations.delete(readable)) == len(readable)


def _run_doc(row: RunSettings) -> dict[str, Any]:
    return {"name": row.name, "created_at": row.created_at, "parent_version": row.parent_version,
            "retention": row.retention, "redundancy": row.redundancy, "delta_chain": row.delta_chain,
            "delta_policy": row.delta_policy}


def record_run(locations: LocationSet, catalog: Any, run: str) -> None:
    """Mirror a run's fork point and policies, as the catalog has them now."""
    row = run_settings(catalog, run)
    if row is not None:
        _put(locations, catalog, objectnames.ref_name(RUNS, run, catalog.crypto.name_hash), _run_doc(row))


def _store_doc(catalog: Any) -> dict[str, Any]:
    return {"redundancy": REDUNDANCY.stored(catalog), "delta_chain": DELTA_CHAIN.stored(catalog),
            "delta_policy": DELTA_POLICY.stored(catalog)}


def record_store(locations: LocationSet, catalog: Any) -> None:
    """Mirror store-wide settings (redundancy, delta chain and policy)."""
    _put(locations, catalog, STORE, _store_doc(catalog))


def _locations_doc(catalog: Any) -> dict[str, Any]:
    return {"locations": [{"name": row.name, "url": row.url, "domain": row.domain, "state": row.state}
                          for row in shard_sql.locations(catalog)]}


def record_locations(locations: LocationSet, catalog: Any) -> None:
    """Mirror the store's locations, their failure domains and states."""
    _put(locations, catalog, LOCATIONS, _locations_doc(catalog))


def _mirror_doc(row: mirror_sql.MirrorRow) -> dict[str, Any]:
    return {"name": row.name, "destination": redact_url(row.destination),
            "key_file": None if row.key_file is None else redact_url(row.key_file),
            "selection": row.selection, "propagate_deletions": row.propagate_deletions,
            "created_at": row.created_at}


def record_mirror(locations: LocationSet, catalog: Any, name: str) -> None:
    """Mirror mirror ``name``'s definition, as the catalog has it now (none: it is gone); one
    whose paths must be recorded redacted is warned about (a rebuild cannot restore it)."""
    for row in (row for row in mirror_sql.mirrors(catalog) if row.name == name):
        doc = _mirror_doc(row)
        if (doc["destination"], doc["key_file"]) != (row.destination, row.key_file):
            log.warning("mirror %r: its destination or key file path looks like it holds a "
                        "credential, so its record is written redacted and a catalog rebuild will "
                        "not restore the mirror (add it again then); a path without one avoids "
                        "this", name)
        _put(locations, catalog, objectnames.ref_name(MIRRORS, name, catalog.crypto.name_hash), doc)


def drop_mirror(locations: LocationSet, catalog: Any, name: str) -> None:
    """Remove mirror ``name``'s record from every readable location (it was removed). A location
    that refuses is logged: its copy would bring the mirror back in a catalog rebuild."""
    key = objectnames.ref_name(MIRRORS, name, catalog.crypto.name_hash)
    readable = [(loc.id, key) for loc in locations.all if loc.readable]
    if len(locations.delete(readable)) < len(readable):
        log.warning("the record of removed mirror %r is left on a blob location (see above); a "
                    "catalog rebuild would bring the mirror back (remove it again then)", name)


def unknown_mirrors(listed: Iterable[str], wanted: Mapping[str, Any]) -> list[str]:
    """The mirror records among ``listed`` object names that ``wanted`` (:func:`expected`) lacks:
    left by a removal a location refused, or of a mirror a rebuild could not restore."""
    return sorted(key for key in listed if key.startswith(MIRRORS) and key not in wanted)


def removed_mirror_keys(catalog: Any) -> set[str]:
    """The record keys of mirrors whose removal the audit log holds and that the catalog no
    longer has: the only mirror records ``repair`` may delete. A record of a mirror with no
    logged removal (a rebuild that could not restore it, audit off) is never deleted: it may be
    the last copy of a definition."""
    have = {row.name for row in mirror_sql.mirrors(catalog)}
    gone = {str(e.target).removeprefix("mirror:") for e in catalog.audit_entries(action="mirror.remove")
            if e.target is not None and e.target.startswith("mirror:")}
    return {objectnames.ref_name(MIRRORS, name, catalog.crypto.name_hash) for name in gone - have}


_COMPARED = {TAGS: ("name", "version"),
             RUNS: ("name", "created_at", "parent_version", "retention", "redundancy", "delta_chain",
                    "delta_policy"),
             STORE: ("redundancy", "delta_chain", "delta_policy"),
             LOCATIONS: ("locations",),
             MIRRORS: ("name", "destination", "key_file", "selection", "propagate_deletions", "created_at")}


def expected(catalog: Any) -> dict[str, dict[str, Any]]:
    """The records the catalog implies now, by key (what ``check`` compares, ``repair`` writes)."""
    out: dict[str, dict[str, Any]] = {}
    tags, runs = tags_and_runs(catalog)
    for name, version in tags:
        out[objectnames.ref_name(TAGS, name, catalog.crypto.name_hash)] = {"name": name, "version": version}
    for row in runs:
        doc = _run_doc(row)
        if any(doc[k] is not None for k in ("parent_version", "retention", "redundancy", "delta_chain",
                                            "delta_policy")):
            out[objectnames.ref_name(RUNS, row.name, catalog.crypto.name_hash)] = doc
    store = _store_doc(catalog)
    if any(value is not None for value in store.values()):
        out[STORE] = store
    out[LOCATIONS] = _locations_doc(catalog)
    for mirror in mirror_sql.mirrors(catalog):
        out[objectnames.ref_name(MIRRORS, mirror.name, catalog.crypto.name_hash)] = _mirror_doc(mirror)
    return out


RENAMED_STATES = {"draining": "retiring"}  # pre-0012 spelling -> now
"""Location states older ``refs/locations`` records spell by an earlier name (casckpt before
catalog schema 0012), by the name they have now: the records are read back (``check``,
``repair``, ``catalog rebuild``) with the state renamed, so a store written before the rename
opens, checks clean and rebuilds."""


def location_state(stored: str) -> str:
    """A location state as a ``refs/locations`` record holds it, by the name it has now."""
    return RENAMED_STATES.get(stored, stored)


def _current(key: str, doc: dict[str, Any]) -> dict[str, Any]:
    """A record as casckpt writes it now (a locations record's older state names renamed)."""
    entries = doc.get("locations")
    if not key.startswith(LOCATIONS) or not isinstance(entries, list):
        return doc
    return {**doc, "locations": [{**e, "state": location_state(e["state"])}
                                 if isinstance(e, dict) and isinstance(e.get("state"), str) else e
                                 for e in entries]}


def agrees(key: str, doc: object, want: dict[str, Any]) -> bool:
    """Whether a record read from a location says what the catalog implies (seq and time aside)."""
    prefix = next((p for p in _COMPARED if key.startswith(p)), None)
    return prefix is not None and isinstance(doc, dict) and all(
        _current(key, doc).get(field) == want.get(field) for field in _COMPARED[prefix])


def parse(data: bytes) -> dict[str, Any]:
    """A record's JSON object.

    Raises:
        ValueError: it is not one (not JSON, too deeply nested, not an object).
    """
    if json_nesting(data) > _MAX_NESTING:
        raise ValueError("nested too deeply to be a record")
    doc = json.loads(data)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    return doc


@dataclass(frozen=True, slots=True)
class Found:
    """One copy of a record, where it was read."""

    doc: dict[str, Any]
    location: Location

    @property
    def order(self) -> tuple[int, float]:
        """Newest first by counter, then by time (records from before counters, or with a
        value no writer produces: 0)."""
        return _number(self.doc.get("seq"), int, 1 << 62), _number(self.doc.get("at"), float, 1e12)


def _number(value: object, kind: type, limit: float) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -limit < value < limit:
        return kind(0)
    return kind(value)


def valid_run(doc: dict[str, Any]) -> bool:
    """Whether a run record holds what :func:`record_run` writes, each field of its type."""
    name, created = doc.get("name"), doc.get("created_at")
    parent, retention = doc.get("parent_version"), doc.get("retention")
    redundancy, chain = doc.get("redundancy"), doc.get("delta_chain")
    return (isinstance(name, str) and 0 < len(name) <= 128
            and _number(created, float, 1e12) == created and created is not None
            and (parent is None or (isinstance(parent, str) and _HEX_ID.match(parent) is not None))
            and (retention is None or isinstance(retention, dict))
            and (redundancy is None or (isinstance(redundancy, str) and len(redundancy) <= 32))
            and (chain is None or (isinstance(chain, int) and not isinstance(chain, bool)
                                   and 0 <= chain <= 64))
            and doc.get("delta_policy") in (None, *DELTA_POLICIES))


def valid_mirror(doc: dict[str, Any]) -> bool:
    """Whether a mirror record holds what :func:`record_mirror` writes, each field of its type
    (the selection is checked when it is read back: :func:`casckpt.mirror_rules.selection_from_json`)."""
    name, destination, key_file, created = (doc.get("name"), doc.get("destination"), doc.get("key_file"),
                                            doc.get("created_at"))
    return (isinstance(name, str) and 0 < len(name) <= 128
            and isinstance(destination, str) and 0 < len(destination) <= 4096
            and (key_file is None or (isinstance(key_file, str) and 0 < len(key_file) <= 4096))
            and isinstance(doc.get("selection"), dict) and isinstance(doc.get("propagate_deletions"), bool)
            and _number(created, float, 1e12) == created and created is not None)


def ranked(copies: Iterable[Found], states: dict[str, str]) -> list[Found]:
    """The copies best first: from an active location if any has one (a retiring or failed
    location may hold a copy repair no longer updates), then the highest counter."""
    return sorted(copies, key=lambda f: (states.get(f.location.name, f.location.state) == "active",
                                         *f.order), reverse=True)


def newest(copies: Iterable[Found], states: dict[str, str]) -> Found | None:
    """The copy that wins (:func:`ranked`'s first)."""
    return next(iter(ranked(copies, states)), None)


def read_all(locations: LocationSet, prefix: str) -> dict[str, list[Found]]:
    """Every readable copy of every record under ``prefix``, on every readable location, by key.

    Raises:
        StorageError: a location cannot be listed.
    """
    out: dict[str, list[Found]] = {}
    for loc, info in locations.list_all(prefix):
        try:
            doc = parse(loc.blobs.get(info.key, max_size=MAX_RECORD))
        except AccessDeniedError:
            raise  # refused, not damaged or missing: stop, naming the right
        except (CasckptError, ValueError, RecursionError) as exc:
            log.warning("skipping unreadable record %s on %s: %s", info.key, loc.describe(), exc)
            continue
        out.setdefault(info.key, []).append(Found(doc, loc))
    return out

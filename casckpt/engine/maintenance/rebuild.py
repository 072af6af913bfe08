"""Catalog disaster recovery: rebuild the catalog from the blob locations alone.

Everything the catalog records is recoverable from the objects:

1. Packs: every ``packs/`` object on every readable location. A whole pack
   (``packs/<xx>/<id>``) is a copy; several copies make a ``replicate`` pack.
   An erasure-coded shard (``<id>.s<i>``) names its pack, index and scheme
   in its header. Each pack is recorded with its shards, then its footer is
   read by range (through the data shards when erasure-coded) to recover
   its chunk rows.
2. Versions: every manifest (``manifests/<id>``, verified against its id)
   gives run, step, parent, time, metadata, metrics, message, commit-time
   tags and the tensors; a version is published only if every chunk it
   references was recovered. A manifest of version 1 whose tree (the one
   ``casckpt catalog migrate-trees`` gave it) has every node in the packs
   comes back migrated: its tree root and node rows, no tensor rows.
3. Mutable state from ``refs/`` records (see :mod:`casckpt.engine.versions.records`):
   location domains and states, forks, retention, redundancy and delta-chain
   policies of runs and of the store, tags set after commit, the definitions of the
   store's mirrors (not what their runs recorded). The copy on an active location wins,
   then the highest counter.

Not recoverable (``docs/ARCHITECTURE.md``, "Catalog rebuild", lists every
column that differs, and ``tests/engine/maintenance/test_recovery.py`` holds a rebuild to it):
commit durations and new/stored byte counts (recorded as 0), commit times
(the creation time), soft deletions (such versions come back visible; the
next ``gc`` re-applies retention), GC history, what mirror runs recorded
(what was sent, failures, the last run), and how many copies a ``replicate``
pack had when some are gone (it comes back with the copies found).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any

from casckpt.catalog import MissingChunksError, PackLayout, ShardRow, StoredPack, inventory
from casckpt.catalog import identity as identity_sql
from casckpt.catalog import mirrors as mirror_sql
from casckpt.catalog import shards as shard_sql
from casckpt.catalog.deltas import DELTA_POLICIES
from casckpt.catalog.settings import DELTA_CHAIN, DELTA_POLICY, REDUNDANCY
from casckpt.config import check_store_path
from casckpt.engine.context import EngineContext
from casckpt.engine.locations import identity
from casckpt.engine.locations.discovery import FoundPack, pack_layout, scan_packs
from casckpt.engine.maintenance import scrub
from casckpt.engine.maintenance.gcguard import Listing
from casckpt.engine.read import treeindex, trees
from casckpt.engine.versions import records
from casckpt.engine.versions.validate import check_name
from casckpt.errors import CasckptError, CorruptPackError, InvalidArgumentError, StoreIdentityError
from casckpt.format import objectnames
from casckpt.format.identity import StoreIdentity
from casckpt.format.manifest import MAX_MANIFEST_OBJECT, Manifest, decode_manifest
from casckpt.format.pack import read_index
from casckpt.mirror_rules import selection_from_json
from casckpt.storage import BlobInfo
from casckpt.storage.erasure import Redundancy
from casckpt.storage.locations import Location
from casckpt.types import ProgressCallback, RebuildReport

log = logging.getLogger(__name__)

def _recover_pack(ctx: EngineContext, layout: PackLayout) -> int:
    """Read a pack back (streamed, verified against its id), then record it, its shards and its
    chunks. A pack with a damaged data shard is rebuilt in memory from healthy ones, if its
    shards are no larger than :data:`scrub.IN_MEMORY_LIMIT` in all.

    Returns the number of chunks. Shards found damaged are recorded so (and
    shards an erasure-coded pack lacks, as missing): ``repair`` restores them.
    """
    listed: scrub.Listed = {}
    for sh in layout.shards:
        listed.setdefault(sh.location_id, {})[sh.key] = BlobInfo(sh.key, sh.size, 0.0)
    verdict = scrub.verify(ctx.locations, layout, listed, ctx.crypto.chunk_id)
    states = {sh.index: verdict.damaged.get(sh.index, "ok") for sh in layout.shards}
    entries = verdict.entries
    if not verdict.ok:
        if layout.scheme != "ec" or sum(sh.size for sh in layout.shards) > scrub.IN_MEMORY_LIMIT:
            raise CorruptPackError("no copy or set of shards reads back as the pack")
        data, states = ctx.packs.verifier.read_detached(layout)
        if data is None:
            raise CorruptPackError("too few intact shards to read it back")
        entries = read_index(data)
    if not entries:
        raise CorruptPackError("its footer cannot be read")
    rows = [replace(sh, state=states.get(sh.index, "missing")) for sh in layout.shards]
    if layout.scheme == "ec" and rows:
        present = {sh.index for sh in rows}
        rows += [ShardRow(i, rows[0].location_id, objectnames.shard_name(layout.id, i), 0, None, "missing")
                 for i in range(layout.k + layout.m) if i not in present]
    ctx.catalog.add_pack(StoredPack(replace(layout, shards=tuple(rows)), entries))
    shard_sql.set_pack_chunks(ctx.catalog, layout.id, len(entries))
    return len(entries)


def _manifests(ctx: EngineContext, listing: Listing,
               skipped: list[str]) -> list[tuple[Manifest, bytes, str]]:
    """Every manifest found, verified against its id (each copy tried until one is)."""
    holders: dict[str, list[Location]] = {}
    for loc, info in listing:
        if (named := objectnames.version_of(info.key)) is not None:
            holders.setdefault(named, []).append(loc)
    out = []
    for version_id, locations in sorted(holders.items()):
        problem: CasckptError | None = None
        for loc in locations:
            try:
                data = loc.blobs.get(objectnames.manifest_name(version_id), max_size=MAX_MANIFEST_OBJECT)
                out.append((decode_manifest(data, version_id), data, version_id))
                break
            except CasckptError as exc:
                problem = exc
        else:
            skipped.append(f"{version_id}: manifest unreadable ({problem})")
    out.sort(key=lambda pair: (pair[0].created_at, pair[0].run, pair[0].step))
    return out


def _publish(ctx: EngineContext, manifest: Manifest, data: bytes, version_id: str) -> None:
    manifest, node_rows = trees.recovered(ctx, manifest, data, version_id)
    rows, contents = trees.catalog_rows(version_id, manifest)
    row = {
        "id": version_id, "step": manifest.step, "parent_id": manifest.parent, "state": "visible",
        "created_at": manifest.created_at, "committed_at": manifest.created_at,
        "logical_bytes": manifest.logical_bytes, "new_bytes": 0, "stored_bytes": 0,
        "duration_s": 0.0, "meta": dict(manifest.metadata), "metrics": dict(manifest.metrics),
        "message": manifest.message, "manifest": data, "tree_root": trees.root_of(manifest),
    }
    chunk_ids = [cid.hex() for cid in manifest.chunk_ids()]  # every one: nothing is known yet
    ctx.catalog.add_version(row, manifest.run, rows, contents, manifest.tags, chunk_ids, node_rows,
                            audit=False)  # the rebuild is recorded once, as catalog.rebuild


def rebuild(ctx: EngineContext, progress: ProgressCallback | None = None) -> RebuildReport:
    """Fill an empty catalog from the blob locations (see the module docstring).

    Raises:
        InvalidArgumentError: the catalog already holds versions or packs.
        StorageError: a location cannot be listed.
        StoreIdentityError: the locations belong to different stores (nothing was changed).
    """
    started = time.monotonic()
    if identity_sql.rebuilding(ctx.catalog):
        raise InvalidArgumentError(
            "this catalog holds a rebuild that did not finish; rebuild into a new, empty catalog: "
            "move this one away (SQLite) or create an empty database (PostgreSQL) first")
    if not shard_sql.is_empty(ctx.catalog):
        raise InvalidArgumentError(
            "the catalog is not empty; `catalog rebuild` fills a new, empty catalog. Move the "
            "old catalog away (SQLite) or create an empty database (PostgreSQL) first")
    identity_sql.set_rebuilding(ctx.catalog, True)  # until the last record is restored
    found_records = records.read_all(ctx.locations, objectnames.REFS)
    recorded = _recorded_locations(found_records)
    states = {name: state for name, _, _, state in recorded}
    _adopt_identity(ctx, states)
    _restore_locations(ctx, recorded)
    listing = _listing(ctx, states)
    found = scan_packs((loc, info) for loc, info in listing if info.key.startswith(objectnames.PACKS))
    packs = chunks = 0
    lost: list[str] = []
    for done, (pack_id, objects) in enumerate(sorted(found.items()), 1):
        layout = pack_layout(pack_id, _prefer_active(objects, states))
        try:
            if layout is None or len(layout.shards) < layout.k:
                raise CasckptError("too few readable shards")
            chunks += _recover_pack(ctx, layout)
            packs += 1
        except CasckptError as exc:
            log.warning("rebuild: pack %s is lost: %s", pack_id, exc)
            lost.append(pack_id)
        if progress is not None:
            progress("packs", done, len(found))
    skipped: list[str] = []
    manifests = _manifests(ctx, listing, skipped)
    versions = 0
    for done, (manifest, data, version_id) in enumerate(manifests, 1):
        try:
            _publish(ctx, manifest, data, version_id)
            versions += 1
        except MissingChunksError as exc:
            skipped.append(f"{version_id}: {len(exc.missing)} of its chunks were not found")
        except CasckptError as exc:
            skipped.append(f"{version_id}: {exc}")
        if progress is not None:
            progress("versions", done, len(manifests))
    runs, tags = _restore_records(ctx, found_records, states)
    treeindex.backfill(ctx.catalog)  # what tensor history reads, from the trees just restored
    ctx.cache.clear()
    return RebuildReport(packs=packs, chunks=chunks, versions=versions, runs=runs, tags=tags,
                         lost_packs=tuple(lost), skipped=tuple(skipped),
                         duration_s=time.monotonic() - started)


def _adopt_identity(ctx: EngineContext, states: dict[str, str]) -> None:
    """Make the new catalog the store's: its id and creation time from the locations' identity
    records, its generation one above theirs; then record that on every location, so a catalog
    from before the rebuild (a lower generation) is refused from now on. Locations recorded as
    failed are neither trusted nor touched (a failed location is never written; if it comes
    back, opening the store rewrites its record of an older generation).

    Raises:
        StoreIdentityError: the locations belong to different stores.
    """
    usable = [loc for loc in ctx.locations.all if loc.readable and states.get(loc.name) != "failed"]
    records_found = {}
    for loc in usable:
        try:
            record = identity.read_record(loc.blobs)
        except CasckptError as exc:
            log.warning("rebuild: identity record of %s unusable: %s", loc.describe(), exc)
            continue
        if record is not None:
            records_found[loc.name] = record
    stores = {r.store_id for r in records_found.values()}
    if len(stores) > 1:
        raise StoreIdentityError(
            "the blob locations belong to different stores (" + ", ".join(
                f"{name}: {r.store_id}" for name, r in sorted(records_found.items())) +
            "); rebuild each store from its own locations (fix casckpt.toml) -- nothing was changed")
    mine = identity_sql.read(ctx.catalog)
    if records_found:
        first = next(iter(records_found.values()))
        mine = StoreIdentity(first.store_id, first.created_at,
                             max(r.generation for r in records_found.values()))
    adopted = replace(mine, generation=mine.generation + 1)
    identity_sql.write(ctx.catalog, adopted)
    for loc in usable:
        try:
            identity.write_record(loc.blobs, adopted, loc.name)
        except CasckptError as exc:
            log.warning("rebuild: could not write the identity record of %s: %s", loc.describe(), exc)


def _listing(ctx: EngineContext, states: dict[str, str]) -> Listing:
    """Packs and manifests on every location not failed, active locations first."""
    rank = {"active": 0, "retiring": 1}
    out = [(loc, info) for prefix in (objectnames.PACKS, objectnames.MANIFESTS)
           for loc, info in ctx.locations.list_all(prefix) if states.get(loc.name, "active") != "failed"]
    out.sort(key=lambda pair: rank.get(states.get(pair[0].name, "active"), 2))
    return out


def _prefer_active(found: FoundPack, states: dict[str, str]) -> FoundPack:
    """Copies on active locations when there are any (a retiring location keeps stale ones)."""
    active = [c for c in found.copies if states.get(c[0].name, "active") == "active"]
    return FoundPack(active or found.copies, found.shards)


def _newest(found: dict[str, list[records.Found]], prefix: str,
            states: dict[str, str]) -> list[dict[str, Any]]:
    docs = []
    for key, copies in sorted(found.items()):
        if key.startswith(prefix) and (best := records.newest(copies, states)) is not None:
            docs.append(best.doc)
    return docs


_LocationEntry = tuple[str, str | None, str, str]  # name, url, failure domain, state


def _recorded_locations(found: dict[str, list[records.Found]]) -> list[_LocationEntry]:
    """The locations the newest locations record names (entries that make no sense skipped)."""
    doc = next(iter(_newest(found, objectnames.LOCATIONS_RECORD, {})), None)
    entries = doc.get("locations") if doc is not None else None
    out: list[_LocationEntry] = []
    for entry in entries if isinstance(entries, list) else ():
        try:
            name, state, domain, url = entry["name"], entry["state"], entry["domain"], entry.get("url")
            state = records.location_state(state) if isinstance(state, str) else state  # older names
        except (KeyError, TypeError, AttributeError) as exc:
            log.warning("rebuild: skipping location entry %r: %s", entry, exc)
            continue
        if not all(isinstance(v, str) and 0 < len(v) <= 128 for v in (name, state, domain)) or not (
                url is None or (isinstance(url, str) and len(url) <= 4096)):
            log.warning("rebuild: skipping location entry %r: fields of the wrong type", entry)
        elif state not in shard_sql.LOCATION_STATES:
            log.warning("rebuild: skipping location entry %r: no such state", entry)
        else:
            out.append((name, url, domain, state))
    return out


def _restore_locations(ctx: EngineContext, recorded: list[_LocationEntry]) -> None:
    """Location domains and states as recorded.

    A location the record names but this host's config does not is registered (other hosts
    may reach it); its objects are not read by this rebuild.
    """
    known = {loc.name for loc in ctx.locations.all}
    for name, url, domain, state in recorded:
        shard_sql.restore_location(ctx.catalog, name, url, domain, state)
        if name not in known:
            log.warning("rebuild: location %s is recorded but not configured on this host; its "
                        "objects were not read (add it to casckpt.toml and rebuild again)", name)


def _restore_runs(ctx: EngineContext, found: dict[str, list[records.Found]], states: dict[str, str]) -> int:
    shard_sql.date_runs_from_versions(ctx.catalog)
    for doc in _newest(found, objectnames.RUNS, states):
        if not records.valid_run(doc):
            log.warning("rebuild: skipping a damaged run record %r", doc)
            continue
        try:
            shard_sql.restore_run(ctx.catalog, str(doc["name"]), float(doc["created_at"]),
                                  doc.get("parent_version"), doc.get("retention"), doc.get("redundancy"))
            if doc.get("delta_chain") is not None:
                DELTA_CHAIN.set_run(ctx.catalog, str(doc["name"]), int(doc["delta_chain"]))
            if doc.get("delta_policy") is not None:
                DELTA_POLICY.set_run(ctx.catalog, str(doc["name"]), str(doc["delta_policy"]))
        except (KeyError, TypeError, ValueError, CasckptError) as exc:
            log.warning("rebuild: skipping run record %r: %s", doc, exc)
    return len(ctx.catalog.run_names())


def _restore_tags(ctx: EngineContext, found: dict[str, list[records.Found]], states: dict[str, str]) -> int:
    for doc in _newest(found, objectnames.TAGS, states):
        name, version = doc.get("name"), doc.get("version")
        if isinstance(name, str) and isinstance(version, str) and ctx.catalog.version(version) is not None:
            ctx.catalog.set_tag(name, version)
    return len(ctx.catalog.tag_names())


def _restore_store(ctx: EngineContext, found: dict[str, list[records.Found]], states: dict[str, str]) -> None:
    doc = next(iter(_newest(found, objectnames.STORE_RECORD, states)), {})
    redundancy, chain = doc.get("redundancy"), doc.get("delta_chain")
    try:
        if isinstance(redundancy, str) and redundancy:
            REDUNDANCY.set_store(ctx.catalog, str(Redundancy.parse(redundancy)))
        if isinstance(chain, int) and not isinstance(chain, bool) and 0 <= chain <= 64:
            DELTA_CHAIN.set_store(ctx.catalog, chain)
        if doc.get("delta_policy") in DELTA_POLICIES:
            DELTA_POLICY.set_store(ctx.catalog, str(doc["delta_policy"]))
    except (TypeError, ValueError, CasckptError) as exc:
        log.warning("rebuild: skipping store record %r: %s", doc, exc)


def _restore_mirrors(ctx: EngineContext, found: dict[str, list[records.Found]],
                     states: dict[str, str]) -> None:
    """Each mirror's definition, as its newest copy that makes sense has it (a damaged copy,
    or one this casckpt cannot run, falls back to the next-newest on another location); never
    its runs' outcomes (the first run after the rebuild finds what the destination holds)."""
    for key, copies in sorted(found.items()):
        if not key.startswith(objectnames.MIRRORS):
            continue
        for copy in records.ranked(copies, states):
            try:
                mirror_sql.restore(ctx.catalog, _mirror_row(copy.doc))
                break
            except CasckptError as exc:
                log.warning("rebuild: skipping mirror record %r on %s: %s", copy.doc,
                            copy.location.describe(), exc)
        else:
            log.warning("rebuild: no copy of mirror record %s makes sense; the mirror is not "
                        "restored (its records are kept: add it again with casckpt mirror add)", key)


def _restore_records(ctx: EngineContext, found: dict[str, list[records.Found]],
                     states: dict[str, str]) -> tuple[int, int]:
    """Runs, tags, store settings and mirrors from their records, then the rebuild is done;
    how many runs and tags."""
    runs = _restore_runs(ctx, found, states)
    tags = _restore_tags(ctx, found, states)
    _restore_store(ctx, found, states)
    _restore_mirrors(ctx, found, states)
    identity_sql.raise_record_seq(ctx.catalog, 1 + max(
        (f.order[0] for copies in found.values() for f in copies), default=0))
    identity_sql.set_rebuilding(ctx.catalog, False)
    return runs, tags


def _mirror_row(doc: dict[str, Any]) -> mirror_sql.MirrorRow:
    """The mirror a record defines, checked as ``mirrors.add`` checks what it is told.

    Raises:
        CasckptError: the record is damaged, redacted, or names what ``mirrors.add`` refuses.
    """
    if not records.valid_mirror(doc):
        raise InvalidArgumentError("fields missing or of the wrong type")
    name, destination = str(doc["name"]), str(doc["destination"])
    check_name(name, "mirror")
    if records.REDACTED in destination + (doc.get("key_file") or ""):
        raise InvalidArgumentError(
            "its destination or key file path looked like it held a credential and was "
            f"recorded redacted; add the mirror again (casckpt mirror add {name} ...)")
    check_store_path(destination)
    if not os.path.isabs(destination) or not os.path.isabs(doc.get("key_file") or "/"):
        raise InvalidArgumentError("its destination or key file is not an absolute path, as "
                                   "mirrors.add records them")
    selection_from_json(doc["selection"], name)  # a selection this casckpt can run
    return mirror_sql.MirrorRow(name, destination, doc.get("key_file"), dict(doc["selection"]),
                                bool(doc["propagate_deletions"]), float(doc["created_at"]),
                                None, None, None)


def refill_cache(ctx: EngineContext) -> int:
    """Empty this host's index cache and fill it from the catalog's live chunks."""
    ctx.cache.clear()
    count = 0
    for batch in inventory.live_chunk_batches(ctx.catalog):
        ctx.cache.put_many((bytes.fromhex(r.id), r.pack_id, r.offset, r.stored_len, r.raw_len, r.codec)
                           for r in batch)
        count += len(batch)
    return count

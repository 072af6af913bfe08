"""Garbage collection: apply retention, then reclaim what no version needs.

One run, holding the store-wide GC lock:

1. List the blob store (before anything is deleted: a listing error aborts
   the run with nothing deleted).
2. Apply retention: soft-delete the versions the runs' policies drop.
3. Purge versions soft-deleted longer ago than the grace period.
4. Mark: collect the chunks visible versions reference (in the catalog).
5. Revive condemned chunks that are referenced again; condemn live chunks
   nothing references, made before the oldest commit in flight began.
6. Sweep: remove chunk rows condemned before ``now - grace`` and still
   unreferenced (re-marking first when this run's condemnations qualify),
   then packs no chunk row points at; rows go first, objects after.
7. Delete objects no catalog row knows, older than the grace period and than
   the oldest commit in flight.
8. Repack packs mostly dead: copy their live chunks into new packs and point
   the chunk rows at the copies (the old packs go in a later run).

A commit racing with GC is safe without any grace period: its lease keeps
its fresh chunks and objects out of reach, publishing revives condemned
chunks it references, and chunks already swept are written again. The grace
period protects readers (a restore of a version deleted meanwhile) and
gives ``undelete`` a window.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from functools import partial

from casckpt.catalog import gc as sql
from casckpt.catalog import retention as retention_sql
from casckpt.engine import retention
from casckpt.engine.context import EngineContext, manifest_key
from casckpt.engine.packer import Packer
from casckpt.engine.reader import read_chunks
from casckpt.errors import CasckptError, IntegrityError, StorageError
from casckpt.format.pack import ENTRY_HEADER_SIZE, PackEntry, decode_entry
from casckpt.storage import BlobInfo
from casckpt.storage.erasure import Redundancy
from casckpt.types import GCReport, ProgressCallback, RetentionPlan

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 6 * 3600.0
REPACK_MAX_LIVE = 0.5


@dataclass(slots=True)
class _Tally:
    versions_deleted: int = 0
    versions_purged: int = 0
    chunks_condemned: int = 0
    chunks_revived: int = 0
    chunks_swept: int = 0
    packs_deleted: int = 0
    packs_repacked: int = 0
    orphans_deleted: int = 0
    bytes_freed: int = 0
    chunks_kept_as_bases: int = 0


def _apply_retention(ctx: EngineContext, dry_run: bool) -> tuple[RetentionPlan, ...]:
    """Plan every run's policy and soft-delete what it drops, in ONE transaction.

    A tag or fork added concurrently either lands before (and protects its
    version) or after (and finds the version deleted).
    """
    with ctx.catalog.write() as conn:
        plans = tuple(retention.plan(h) for h in retention_sql.load_histories(conn))
        if not dry_run:
            retention_sql.soft_delete(conn, [v.id for p in plans for v in p.deleted], "retention")
    return plans


_Object = tuple[int, str]  # (location id, object key)


def _listing(ctx: EngineContext) -> list[tuple[int, BlobInfo]]:
    """Packs, shards and manifests on every readable location (an error aborts GC)."""
    return [(loc.id, info) for prefix in ("packs/", "manifests/")
            for loc, info in ctx.locations.list_all(prefix)]


def _delete_objects(ctx: EngineContext, objects: list[_Object], progress: ProgressCallback | None) -> int:
    deleted = 0
    for location_id, key in objects:
        loc = ctx.locations.get(location_id)
        try:
            if loc is not None and loc.readable:  # a failed location is never touched
                loc.blobs.delete(key)
                deleted += 1
        except CasckptError as exc:  # the row is gone: the object is an orphan for a later run
            log.warning("gc: could not delete %s (%s); a later gc removes it", key, exc)
        if progress is not None:
            progress("sweep", deleted, len(objects))
    return deleted


def _everywhere(ctx: EngineContext, key: str) -> list[_Object]:
    return [(loc.id, key) for loc in ctx.locations.all if loc.readable]


def _mark_and_sweep(ctx: EngineContext, tally: _Tally, *, grace: float, dry_run: bool,
                    exclude: set[str], progress: ProgressCallback | None) -> list[_Object]:
    """Mark, revive, condemn and sweep; returns the pack objects it removed."""
    catalog = ctx.catalog
    mark_start = time.time()
    sql.mark(catalog, exclude)
    floor = sql.safe_floor(catalog, mark_start)
    tally.chunks_kept_as_bases = sql.mark_bases(catalog, created_after=floor)
    if not dry_run:
        tally.chunks_revived = sql.revive(catalog)
    condemned_at = time.time()
    tally.chunks_condemned, freed = sql.condemn(
        catalog, created_before=floor, now=condemned_at, dry_run=dry_run
    )
    tally.bytes_freed = freed
    cutoff = time.time() - grace
    if cutoff >= condemned_at and not dry_run:
        sql.mark(catalog)  # versions published since the first mark keep their chunks
        sql.mark_bases(catalog, created_after=floor)
        tally.chunks_revived += sql.revive(catalog)
    tally.chunks_swept, dead = sql.sweep(catalog, cutoff=cutoff, dry_run=dry_run)
    tally.packs_deleted = len(dead)
    objects = [obj for p in dead for obj in p.shards]
    if not dry_run:
        _delete_objects(ctx, objects, progress)
    return objects


def _orphans(ctx: EngineContext, listing: list[tuple[int, BlobInfo]], cutoff: float,
             removed: set[_Object]) -> list[_Object]:
    """Listed objects no catalog row knows, old enough, and not removed by this run already."""
    # leases first: a commit that ends after this has recorded its rows before the reads below
    floor = sql.safe_floor(ctx.catalog, cutoff)
    shards = sql.known_shard_keys(ctx.catalog)
    versions = sql.known_version_ids(ctx.catalog)
    orphans = []
    for location_id, info in listing:
        obj = (location_id, info.key)
        known = obj in shards if info.key.startswith("packs/") else (
            info.key.removeprefix("manifests/") in versions
        )
        if not known and info.mtime <= floor and obj not in removed:
            orphans.append(obj)
    return orphans


def _repack_one(ctx: EngineContext, pack_id: str) -> None:
    """Copy a pack's live chunks (verified) into new packs and point their rows at the copies."""
    rows = sql.live_chunks_of(ctx.catalog, pack_id)
    data = memoryview(ctx.packs.get(pack_id))
    layout = ctx.packs.layout(pack_id)
    scheme = Redundancy(layout.scheme, layout.k, layout.m) if layout is not None else Redundancy("none")
    packer = Packer(ctx, scheme,  # the copies keep the redundancy the pack had
                    on_stored=partial(sql.relocate, ctx.catalog, old_pack_id=pack_id))
    try:
        for row in rows:
            base = bytes.fromhex(row.base_id) if row.base_id else None
            entry = PackEntry(bytes.fromhex(row.id), row.offset, row.stored_len, row.raw_len, row.codec, base)
            if base is None:
                decode_entry(data[row.offset : row.offset + entry.span], entry, pack_id)  # verify
            else:  # a delta is verified through its chain (the reader checks the decoded bytes)
                read_chunks(ctx, {entry.chunk_id: [memoryview(bytearray(row.raw_len))]},
                            lambda cid: f"chunk {cid.hex()} of pack {pack_id}")
            start = row.offset + ENTRY_HEADER_SIZE
            packer.add(entry.chunk_id, row.codec, row.raw_len, data[start : start + row.stored_len], base)
        packer.finish()
    except BaseException:
        packer.abort()
        raise


def _repack(ctx: EngineContext, progress: ProgressCallback | None) -> int:
    """Repack mostly dead packs; a pack that cannot be read is left for check / repair."""
    candidates = sql.repack_candidates(ctx.catalog, max_live_fraction=REPACK_MAX_LIVE)
    repacked = 0
    for done, (pack_id, _key, _size) in enumerate(candidates, 1):
        try:
            _repack_one(ctx, pack_id)
            repacked += 1
        except (IntegrityError, StorageError) as exc:
            log.warning("gc: not repacking pack %s: %s (run `casckpt check --read-data`)",
                        pack_id, exc)
        if progress is not None:
            progress("repack", done, len(candidates))
    return repacked


def collect(ctx: EngineContext, *, grace: float, dry_run: bool,
            progress: ProgressCallback | None = None) -> GCReport:
    """Run one garbage collection (see the module docstring). Raises GCRunningError if one runs."""
    started = time.monotonic()
    tally = _Tally()
    with sql.gc_lock(ctx.catalog):
        run_id = sql.start_run(ctx.catalog, dry_run)
        listing = _listing(ctx)
        plans = _apply_retention(ctx, dry_run)
        dropped = {v.id for plan in plans for v in plan.deleted}
        tally.versions_deleted = len(dropped)
        expired = sql.expired_deleted_versions(ctx.catalog, time.time() - grace)
        tally.versions_purged = len(expired)
        removed: set[_Object] = set()
        if not dry_run:
            purged = sql.purge_versions(ctx.catalog, expired)
            tally.versions_purged = len(purged)
            removed = {obj for v in purged for obj in _everywhere(ctx, manifest_key(v))}
            _delete_objects(ctx, sorted(removed), progress)
        removed.update(_mark_and_sweep(ctx, tally, grace=grace, dry_run=dry_run,
                                       exclude=(dropped | set(expired)) if dry_run else set(),
                                       progress=progress))
        orphans = _orphans(ctx, listing, time.time() - grace, removed)
        tally.orphans_deleted = len(orphans) if dry_run else _delete_objects(ctx, orphans, progress)
        if not dry_run:
            tally.packs_repacked = _repack(ctx, progress)
        report = GCReport(dry_run=dry_run, grace_s=grace, retention=plans,
                          duration_s=time.monotonic() - started, **asdict(tally))
        sql.finish_run(ctx.catalog, run_id, {k: v for k, v in report.to_dict().items()
                                             if k != "retention"})
    log.info("gc finished: %s", {k: v for k, v in asdict(tally).items() if v})
    return report

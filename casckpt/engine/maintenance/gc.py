"""Garbage collection: apply retention, then reclaim what no version needs.

One run, holding the store-wide GC lock:

1. List the blob locations (before anything is deleted: a listing error
   aborts the run with nothing deleted), then prove deleting is safe at all
   (:mod:`casckpt.engine.maintenance.gcguard`: the locations carry this catalog's
   identity, every manifest on them is a version or a tombstone the catalog
   knows, few unknown packs) -- else refuse with GCRefusedError.
2. Apply retention: soft-delete the versions the runs' policies drop.
3. Mark: collect the chunks visible versions reference, from their manifests
   (each verified against its id and bound to its catalog row; one that is
   not stops the run before anything is deleted), and the delta bases those
   chunks need.
4. Revive condemned chunks that are referenced again; condemn live chunks
   nothing references, made before the oldest commit in flight began.
5. Sweep: remove chunk rows condemned before ``now - grace`` and still
   unreferenced (re-marking first when this run's condemnations qualify),
   then packs no chunk row points at; rows go first, objects after -- each
   pack's objects only once its footer shows no chunk a version needs.
6. Purge versions soft-deleted longer ago than the grace period (they are
   tombstoned, then their manifest objects deleted).
7. Delete objects no catalog row knows, older than the grace period and than
   the oldest commit in flight, under the same footer check (manifests only
   when tombstoned); and the staging and temporary files dead commits left.
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
from dataclasses import asdict, dataclass, field
from functools import partial

from casckpt.catalog import gc as sql
from casckpt.catalog import retention as retention_sql
from casckpt.catalog.leases import safe_floor
from casckpt.catalog.locks import gc_lock
from casckpt.engine.context import EngineContext
from casckpt.engine.locations.leftovers import reclaim_leftovers
from casckpt.engine.maintenance import retention
from casckpt.engine.maintenance.deleterights import require_delete_rights
from casckpt.engine.maintenance.gcguard import DeletionGuard, Listing, Object
from casckpt.engine.read import trees
from casckpt.engine.read.checkoutwork import reclaim_registered, registry
from casckpt.engine.read.reader import read_chunks
from casckpt.engine.versions.references import references
from casckpt.engine.write.packer import Packer
from casckpt.errors import CasckptError, GCRefusedError, IntegrityError, StorageError
from casckpt.format import objectnames
from casckpt.format.pack import ENTRY_HEADER_SIZE, PackEntry, decode_entry
from casckpt.storage.erasure import Redundancy
from casckpt.storage.scratch import reclaim
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
    bytes_pending: int = 0
    chunks_kept_as_bases: int = 0
    leftovers_deleted: int = 0
    kept: list[str] = field(default_factory=list)


def _apply_retention(ctx: EngineContext, dry_run: bool, run_id: int | None) -> tuple[RetentionPlan, ...]:
    """Plan every run's policy and soft-delete what it drops, in ONE transaction (which also
    counts them in gc run ``run_id``'s row).

    A tag or fork added concurrently either lands before (and protects its
    version) or after (and finds the version deleted).
    """
    with ctx.catalog.write() as conn:
        plans = tuple(retention.plan(h) for h in retention_sql.load_histories(conn))
        if not dry_run:
            dropped = retention_sql.soft_delete(conn, [v.id for p in plans for v in p.deleted], "retention")
            sql.count_in_run(conn, run_id, versions_deleted=dropped)
    return plans


_Marked = tuple[str, "str | None"]  # (version id, tree root) of a version marked
_MARK_BATCH = 50_000


def _listing(ctx: EngineContext) -> Listing:
    """Packs, shards and manifests on every readable location (an error aborts GC)."""
    return [(loc, info) for prefix in (objectnames.PACKS, objectnames.MANIFESTS)
            for loc, info in ctx.locations.list_all(prefix)]


def _mark(ctx: EngineContext, exclude: set[str], done: set[_Marked]) -> set[_Marked]:
    """Add to the mark set every chunk the visible versions not in ``done`` reference, from
    their manifests (verified, bound to their rows); ``exclude`` are treated as gone.

    A version with a tree is marked through its nodes, each read once per mark however many
    versions share it (:func:`treeread.referenced`). ``done`` holds (version id, tree root)
    pairs, so a version migrated to a tree since (:mod:`.treemigrate`) is marked again: its
    nodes are new to this mark.

    Returns the pairs marked (with ``done``).

    Raises:
        GCRefusedError: a manifest or tree node in the catalog cannot be trusted.
    """
    wanted = {i for i, root in sql.visible_roots(ctx.catalog).items()
              if i not in exclude and (i, root) not in done}
    marked = set(done)
    pending: set[str] = set()
    nodes = trees.store_nodes(ctx, heal=False)
    seen: set[bytes] = set()  # nodes walked in this mark, with everything under them
    for batch in sql.manifest_batches(ctx.catalog, wanted):
        for row in batch:
            try:
                for cid in references(row, nodes, seen):
                    pending.add(cid.hex())
                    if len(pending) >= _MARK_BATCH:
                        sql.add_live(ctx.catalog, pending)
                        pending = set()
            except IntegrityError as exc:
                raise GCRefusedError(
                    f"gc stopped before deleting any pack: the catalog's manifest of {row.run}@{row.step} "
                    f"({row.id[:12]}) cannot be trusted ({exc}), so what versions reference is unknown. "
                    "Run `casckpt check`, then `casckpt repair` (it restores a catalog manifest "
                    "from a verified copy on a location)") from exc
            marked.add((row.id, row.tree_root))
    sql.add_live(ctx.catalog, pending)
    return marked


class _Deleter:
    """Deletes objects and counts them and their bytes (sizes from the listing or the catalog),
    in the tally and in gc run ``run_id``'s row (None: a dry run, which deletes nothing)."""

    def __init__(self, ctx: EngineContext, tally: _Tally, listing: Listing,
                 progress: ProgressCallback | None, run_id: int | None) -> None:
        self._ctx, self._tally, self._progress, self.run_id = ctx, tally, progress, run_id
        self.sizes: dict[Object, int] = {(loc.id, info.key): info.size for loc, info in listing}

    def delete(self, objects: list[Object], *, orphans: bool = False) -> int:
        """Delete ``objects`` (:meth:`LocationSet.delete`: errors logged, a later run
        retries); returns how many went."""
        progress = self._progress
        each = None if progress is None else lambda done, total: progress("sweep", done, total)
        deleted = self._ctx.locations.delete(objects, progress=each)
        freed = sum(self.sizes.get(obj, 0) for obj in deleted)
        self._tally.bytes_freed += freed
        if deleted:  # objects are outside any transaction: counted as soon as they are gone
            with self._ctx.catalog.write() as conn:
                sql.count_in_run(conn, self.run_id, bytes_freed=freed,
                                 orphans_deleted=len(deleted) if orphans else 0)
        return len(deleted)


def _everywhere(ctx: EngineContext, key: str) -> list[Object]:
    return [(loc.id, key) for loc in ctx.locations.all if loc.readable]


def _mark_and_sweep(ctx: EngineContext, tally: _Tally, guard: DeletionGuard, deleter: _Deleter, *,
                    grace: float, dry_run: bool, exclude: set[str]) -> list[Object]:
    """Mark, revive, condemn and sweep; returns the pack objects it removed (would remove)."""
    catalog = ctx.catalog
    mark_start = time.time()
    sql.clear_live(catalog)
    marked = _mark(ctx, exclude, set())
    floor = safe_floor(catalog, mark_start)
    tally.chunks_kept_as_bases = sql.mark_bases(catalog, created_after=floor)
    if not dry_run:
        tally.chunks_revived = sql.revive(catalog)
    condemned_at = time.time()
    tally.chunks_condemned, condemned_bytes = sql.condemn(
        catalog, created_before=floor, now=condemned_at, dry_run=dry_run
    )
    cutoff = time.time() - grace
    at_once = cutoff >= condemned_at  # grace 0: what this run condemns, it also sweeps
    if at_once and not dry_run:
        _mark(ctx, set(), marked)  # versions published or undeleted since the first mark
        sql.mark_bases(catalog, created_after=floor)
        tally.chunks_revived += sql.revive(catalog)
    if dry_run:
        tally.chunks_swept, dead = sql.sweep(catalog, cutoff=cutoff, dry_run=True,
                                             condemned_before=floor if at_once else None)
        tally.packs_deleted = len(dead)
        tally.bytes_freed += sum(sh.size for p in dead if p.layout for sh in p.layout.shards)
        tally.bytes_pending = 0 if at_once else condemned_bytes + sql.condemned_bytes(catalog)
        if at_once:  # the packs a real run repacks it deletes in the same run
            repacked = sql.would_repack(catalog, cutoff=cutoff, condemned_before=floor,
                                        max_live_fraction=REPACK_MAX_LIVE)
            tally.packs_repacked = len(repacked)
            tally.bytes_freed += sum(sh.size for p in repacked if p.layout for sh in p.layout.shards)
        return [obj for p in dead for obj in p.shards]
    return _sweep(ctx, tally, guard, deleter, cutoff)


def _sweep(ctx: EngineContext, tally: _Tally, guard: DeletionGuard, deleter: _Deleter,
           cutoff: float) -> list[Object]:
    """Drop condemned chunks and empty packs from the catalog, then the objects the guard clears."""
    swept, dead = sql.sweep(ctx.catalog, cutoff=cutoff, dry_run=False, run_id=deleter.run_id)
    tally.chunks_swept += swept
    tally.packs_deleted += len(dead)
    layouts = [p.layout for p in dead if p.layout is not None]
    deleter.sizes.update(((sh.location_id, sh.key), sh.size) for layout in layouts for sh in layout.shards)
    verdicts = guard.dead_packs(layouts)
    deleter.delete(verdicts.delete)
    tally.kept += verdicts.kept
    return verdicts.delete


def _orphans(ctx: EngineContext, listing: Listing, cutoff: float,
             removed: set[Object]) -> Listing:
    """Listed objects no catalog row knows, old enough, and not removed by this run already."""
    # leases first: a commit that ends after this has recorded its rows before the reads below
    floor = safe_floor(ctx.catalog, cutoff)
    shards = sql.known_shard_keys(ctx.catalog)
    versions = sql.known_version_ids(ctx.catalog)
    orphans = []
    for loc, info in listing:
        obj = (loc.id, info.key)
        known = obj in shards if info.key.startswith(objectnames.PACKS) else (
            info.key.removeprefix(objectnames.MANIFESTS) in versions
        )
        if not known and info.mtime <= floor and obj not in removed:
            orphans.append((loc, info))
    return orphans


def _repack_one(ctx: EngineContext, pack_id: str) -> None:
    """Copy a pack's live chunks (verified) into new packs and point their rows at the copies."""
    rows = sql.live_chunks_of(ctx.catalog, pack_id)
    data = memoryview(ctx.packs.reads.get(pack_id))
    layout = ctx.packs.layouts.get(pack_id)
    scheme = Redundancy(layout.scheme, layout.k, layout.m) if layout is not None else Redundancy("none")
    packer = Packer(ctx, scheme,  # the copies keep the redundancy the pack had
                    on_stored=partial(sql.relocate, ctx.catalog, old_pack_id=pack_id))
    try:
        for row in rows:
            base = bytes.fromhex(row.base_id) if row.base_id else None
            entry = PackEntry(bytes.fromhex(row.id), row.offset, row.stored_len, row.raw_len, row.codec, base)
            if base is None:
                decode_entry(data[row.offset : row.offset + entry.span], entry, pack_id,  # verify
                             ids=ctx.crypto.chunk_id)
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


def collect(ctx: EngineContext, *, grace: float, dry_run: bool, force: bool = False,
            progress: ProgressCallback | None = None) -> GCReport:
    """Run one garbage collection (see the module docstring).

    Raises:
        GCRunningError: another GC holds the lock.
        GCRefusedError: deleting is not proven safe (nothing was changed).
        AccessDeniedError: the credentials lack a right gc needs (nothing was changed).
    """
    started = time.monotonic()
    if dry_run and ctx.catalog.read_only:
        return _preview(ctx, grace, started)
    tally = _Tally()
    # before anything changes; a dry run deletes no object but still keeps its mark set in gc_live
    require_delete_rights(ctx, "gc --dry-run" if dry_run else "gc", objects=not dry_run)
    with gc_lock(ctx.catalog):
        listing = _listing(ctx)
        guard = DeletionGuard(ctx, listing, force=force)
        guard.refuse_unsafe_run(safe_floor(ctx.catalog, time.time()))
        run_id = sql.start_run(ctx.catalog, dry_run)
        deleter = _Deleter(ctx, tally, listing, progress, None if dry_run else run_id)
        try:
            report = _run(ctx, tally, guard, deleter, listing, grace=grace, dry_run=dry_run,
                          progress=progress, started=started)
        except BaseException as exc:  # what a failed run did before it stopped is audited too
            if not dry_run:
                _record_failure(ctx, run_id, tally, exc)
            raise
        sql.finish_run(ctx.catalog, run_id, report.summary())
    log.info("%s", report.describe())
    for note in tally.kept:
        log.warning("gc kept %s", note)
    return report


def _preview(ctx: EngineContext, grace: float, started: float) -> GCReport:
    """A dry run on a read-only store: retention planned in one read transaction and the
    versions a run would purge; nothing marked (marks live in gc's own table), so no space
    is counted (``space_counted=False``)."""
    with ctx.catalog.read() as conn:
        plans = tuple(retention.plan(h) for h in retention_sql.load_histories(conn))
    expired = sql.expired_deleted_versions(ctx.catalog, time.time() - grace)
    return GCReport(dry_run=True, grace_s=grace, retention=plans,
                    versions_deleted=sum(len(p.deleted) for p in plans), versions_purged=len(expired),
                    chunks_condemned=0, chunks_revived=0, chunks_swept=0, packs_deleted=0,
                    packs_repacked=0, orphans_deleted=0, bytes_freed=0,
                    duration_s=time.monotonic() - started, space_counted=False)


def _record_failure(ctx: EngineContext, run_id: int, tally: _Tally, exc: BaseException) -> None:
    counts = {k: v for k, v in asdict(tally).items() if k != "kept"}
    try:
        sql.fail_run(ctx.catalog, run_id, counts, f"{type(exc).__name__}: {exc}")
    except CasckptError as also:  # the catalog may be what failed: the run's own error wins
        log.warning("could not record the failed gc run %s: %s", run_id, also)


def _run(ctx: EngineContext, tally: _Tally, guard: DeletionGuard, deleter: _Deleter, listing: Listing, *,
         grace: float, dry_run: bool, progress: ProgressCallback | None, started: float) -> GCReport:
    """The body of :func:`collect` once its run is recorded (the lock held)."""
    plans = _apply_retention(ctx, dry_run, deleter.run_id)
    dropped = {v.id for plan in plans for v in plan.deleted}
    tally.versions_deleted = len(dropped)
    expired = sql.expired_deleted_versions(ctx.catalog, time.time() - grace)
    tally.versions_purged = len(expired) if dry_run else 0  # a real run counts what it purged
    # mark first: a manifest that cannot be trusted stops the run before anything is deleted
    removed = set(_mark_and_sweep(ctx, tally, guard, deleter, grace=grace, dry_run=dry_run,
                                  exclude=(dropped | set(expired)) if dry_run else set()))
    if not dry_run:
        purged = sql.purge_versions(ctx.catalog, expired, run_id=deleter.run_id)
        tally.versions_purged = len(purged)
        back = sql.republished(ctx.catalog, purged)  # a copy publishing the same id meanwhile
        gone = sorted({obj for v in purged if v not in back
                       for obj in _everywhere(ctx, objectnames.manifest_name(v))})
        deleter.delete(gone)
        removed.update(gone)
    orphans = _orphans(ctx, listing, time.time() - grace, removed)
    if dry_run:
        tally.orphans_deleted = len(orphans)
        tally.bytes_freed += sum(info.size for _, info in orphans)
    else:
        verdicts = guard.orphans(orphans, removed)
        tally.orphans_deleted = deleter.delete(verdicts.delete, orphans=True)
        tally.kept += verdicts.kept + guard.recheck_superseded(verdicts.delete)
        tally.packs_repacked = _repack(ctx, progress)
        if tally.packs_repacked and grace == 0:  # the packs just emptied go in this run too
            _sweep(ctx, tally, guard, deleter, time.time())
        tally.bytes_pending = sql.condemned_bytes(ctx.catalog)
        leftovers = reclaim_leftovers(ctx.staging.base, ctx.locations)  # of dead commits
        if ctx.packs.tier is not None:  # the packs they were filling on this host's fast tier
            leftovers += reclaim(ctx.packs.tier.dir.staging)
        leftovers += reclaim_registered(registry(ctx.staging.base))  # of killed checkouts
        tally.leftovers_deleted, tally.bytes_freed = leftovers.files, tally.bytes_freed + leftovers.nbytes
    counts = {k: v for k, v in asdict(tally).items() if k != "kept"}
    return GCReport(dry_run=dry_run, grace_s=grace, retention=plans, kept=tuple(tally.kept),
                    duration_s=time.monotonic() - started, **counts)

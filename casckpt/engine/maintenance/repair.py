"""Repair: bring every pack, and the recovery data, back to full redundancy.

1. **List** every readable location and compare it with the catalog: a shard
   the catalog thinks healthy but that is not there (or has another size) is
   marked missing or corrupt first, so repair never trusts health it did
   not check.
2. **Packs**: work through the catalog's queue -- shards marked missing or
   corrupt (by this listing, by restores that healed around them, by
   ``check``) and shards on locations marked ``failed`` or ``retiring`` --
   reconstructing each pack from its healthy shards, verifying it against its
   id, and writing the shards it lacks: back to their own location when it
   is active, else to an active location in a failure domain the pack does
   not use yet. A moved shard's old object is left for GC to delete as an
   orphan after the grace period, so other processes still reading through
   the old layout are not cut off.
3. **Recovery data** (what ``catalog rebuild`` needs): a manifest the catalog
   holds damaged is replaced by a verified copy from a location; every
   visible durable version's manifest (a version on a fast tier gets its
   copies from the drain, a lost one none), and every ``refs/`` record the catalog
   implies, is written again on each active location that lacks it or holds
   a copy that differs; an identity record missing or damaged is written
   again where the catalog proves the location is the store's.
4. **Degraded**: packs that still have two shards in one failure domain
   (too few domains are active to spread them) are reported; the repair is
   not ``ok`` until a location is added and repair runs again.

Repair holds a commit lease, so a concurrent GC never takes the shards it
has just written for orphans.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from casckpt.catalog import gc as gc_sql
from casckpt.catalog import identity as identity_sql
from casckpt.catalog import inventory
from casckpt.catalog import shards as shard_sql
from casckpt.catalog.leases import begin_lease, release_lease
from casckpt.catalog.rows import manifest_bytes
from casckpt.engine.context import EngineContext
from casckpt.engine.locations import identity
from casckpt.engine.maintenance import checkmeta
from casckpt.engine.maintenance.checkmeta import Findings
from casckpt.engine.read import trees
from casckpt.engine.read.degraded import doubled_domains
from casckpt.engine.versions import records
from casckpt.engine.versions.refs import bind
from casckpt.errors import AccessDeniedError, BlobNotFoundError, CasckptError, IntegrityError, StorageError
from casckpt.format import objectnames
from casckpt.format.manifest import MAX_MANIFEST_OBJECT, decode_manifest
from casckpt.storage.locations import Location
from casckpt.types import ProgressCallback, RepairReport


@dataclass(slots=True)
class _Recovery:
    catalog_manifests: int = 0
    manifests: int = 0
    records: int = 0
    nodes: int = 0


def repair(ctx: EngineContext, progress: ProgressCallback | None = None) -> RepairReport:
    """Repair the store; see the module docstring."""
    started = time.monotonic()
    found = Findings()
    checkmeta.list_locations(ctx, found)
    layouts = shard_sql.layouts(ctx.catalog, [p.id for p in inventory.live_packs(ctx.catalog)])
    checkmeta.check_presence(ctx, layouts.values(), found)  # marks what the listing lacks
    queue = shard_sql.packs_to_repair(ctx.catalog)
    rewritten = moved = worked = 0
    unrepaired = [f"location {loc.name}: could not be listed, so its shards were left alone (none "
                  "is marked missing); run repair again once it can be reached"
                  for loc in ctx.locations.all if loc.id in found.unlisted]
    lease = begin_lease(ctx.catalog)
    try:
        for done, pack_id in enumerate(queue, 1):
            try:
                outcome = ctx.packs.repairer.repair(pack_id)
            except BlobNotFoundError:  # GC removed the pack meanwhile: nothing to repair
                continue
            if outcome.rewritten or outcome.unplaced or outcome.error:
                worked += 1  # else: doubled-up shards with no free failure domain to go to yet
            rewritten += len(outcome.rewritten)
            moved += sum(1 for _, old, new in outcome.rewritten if old != new)
            if outcome.error or outcome.unplaced:
                reason = outcome.error or (
                    f"shards {list(outcome.unplaced)} found no active location in a failure domain "
                    "the pack does not already use; add a location (`casckpt location add`)")
                unrepaired.append(f"{pack_id}: {reason}")
            if progress is not None:
                progress("repair", done, len(queue))
        recovery = _recovery_data(ctx, found)
        recovery.records += _delete_removed_mirrors(ctx, found)
    finally:
        release_lease(ctx.catalog, lease, "a repair")
    return RepairReport(packs=worked, shards_rewritten=rewritten, shards_moved=moved,
                        unrepaired=tuple(unrepaired), duration_s=time.monotonic() - started,
                        catalog_manifests_restored=recovery.catalog_manifests,
                        manifests_written=recovery.manifests, records_written=recovery.records,
                        tree_nodes_restored=recovery.nodes,
                        degraded=tuple(_degraded(ctx)))


def _delete_removed_mirrors(ctx: EngineContext, found: Findings) -> int:
    """Delete the records of removed mirrors a location kept (see ``check``): only those whose
    removal the audit log holds (:func:`records.removed_mirror_keys`); how many."""
    wanted, removed = records.expected(ctx.catalog), records.removed_mirror_keys(ctx.catalog)
    left = [(loc.id, key) for loc in ctx.locations.all
            for key in records.unknown_mirrors(found.listed.get(loc.id, ()), wanted) if key in removed]
    return len(ctx.locations.delete(left))  # one refused is logged; check keeps reporting it


def _degraded(ctx: EngineContext) -> list[str]:
    """Packs with shards doubled up in one failure domain, as they are after this repair."""
    out = []
    for layout in shard_sql.layouts(ctx.catalog, [p.id for p in inventory.live_packs(ctx.catalog)]).values():
        for domain, indexes in doubled_domains(ctx.locations, layout).items():
            out.append(f"{layout.id}: shards {indexes} share failure domain {domain!r}; add a location "
                       "in another domain (`casckpt location add`), then repair again")
    return out


def copy_recovery_data(ctx: EngineContext, location: Location) -> _Recovery:
    """Give one location (a new one) every manifest and record the catalog implies."""
    found = Findings()
    checkmeta.list_locations(ctx, found)
    return _recovery_data(ctx, found, [location] if location.id in found.listed else [])


def _identity_records(ctx: EngineContext) -> int:
    """Write the identity record where it is missing, damaged or of an older generation, on
    locations the catalog proves are the store's (the rules of opening a store).

    Raises:
        StoreIdentityError: a location holds another store's data.
    """
    mine = identity_sql.read(ctx.catalog)
    lacking = [found for loc in ctx.locations.all if loc.readable
               and (found := identity.survey(loc.name, loc.blobs)).unreachable is None
               and (found.record is None or not mine.same_as(found.record)
                    or found.record.location != loc.name)]
    to_write = identity.check_at_open(ctx.catalog, lacking, recover=False)
    identity.write_records(ctx.catalog, to_write)
    return len(to_write)


def _recovery_data(ctx: EngineContext, found: Findings,
                   holders: list[Location] | None = None) -> _Recovery:
    done = _Recovery()
    if holders is None:
        holders = checkmeta.copies_expected(ctx, found)
        done.records += _identity_records(ctx)
    for batch in gc_sql.manifest_batches(ctx.catalog, gc_sql.visible_ids(ctx.catalog)):
        for row in batch:
            try:
                data = manifest_bytes(row.manifest, row.id)
                bind(row, decode_manifest(data, row.id))
            except IntegrityError:
                restored = _verified_copy(ctx, row)
                if restored is None:
                    continue  # no verified copy anywhere: check keeps reporting it
                gc_sql.replace_manifest(ctx.catalog, row.id, restored)
                done.catalog_manifests += 1
                data = restored
            try:
                done.nodes += trees.restore_node_rows(ctx, data, row.id, row.tree_root)
            except AccessDeniedError:
                raise  # refused, not damaged or missing: stop, naming the right
            except CasckptError:
                pass  # a node intact nowhere: check keeps reporting it
            if row.durability != "durable":
                continue  # on a fast tier: the drain writes it once its packs are there
            for loc in holders:
                if _copy_differs(loc, found, objectnames.manifest_name(row.id), data):
                    try:
                        loc.blobs.put(objectnames.manifest_name(row.id), data)
                        done.manifests += 1
                    except StorageError:
                        pass  # check keeps reporting it
    for key, want in sorted(records.expected(ctx.catalog).items()):
        for loc in holders:
            if _record_differs(loc, found, key, want):
                try:
                    records.write_to(loc, ctx.catalog, key, want)
                    done.records += 1
                except StorageError:
                    pass
    return done


def _verified_copy(ctx: EngineContext, row: Any) -> bytes | None:
    """A copy of the version's manifest from some location that verifies and binds to its row."""
    for loc in ctx.locations.read_order():
        try:
            data = loc.blobs.get(objectnames.manifest_name(row.id), max_size=MAX_MANIFEST_OBJECT)
            bind(row, decode_manifest(data, row.id))
        except AccessDeniedError:
            raise  # refused, not damaged or missing: stop, naming the right
        except CasckptError:
            continue
        return data
    return None


def _copy_differs(loc: Location, found: Findings, key: str, data: bytes) -> bool:
    listed = found.listed.get(loc.id, {}).get(key)
    if listed is None or listed.size != len(data):
        return True
    try:
        return loc.blobs.get(key, max_size=len(data)) != data
    except AccessDeniedError:
        raise  # refused, not damaged or missing: stop, naming the right
    except CasckptError:
        return True


def _record_differs(loc: Location, found: Findings, key: str, want: dict[str, Any]) -> bool:
    if key not in found.listed.get(loc.id, {}):
        return True
    try:
        doc = records.parse(loc.blobs.get(key, max_size=records.MAX_RECORD))
    except AccessDeniedError:
        raise  # refused, not damaged or missing: stop, naming the right
    except (CasckptError, ValueError, RecursionError):
        return True
    return not records.agrees(key, doc, want)

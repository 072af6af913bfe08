"""What GC must prove before it deletes anything (DESIGN.md, invariant 8).

Before a run changes anything:

1. **Identity.** Every readable location carries exactly this catalog's
   store id and generation (:func:`casckpt.engine.locations.identity.require_match`).
2. **Completeness.** Every manifest on the locations is a version the catalog
   holds, a tombstone (a purged version, a commit that never published) or
   the version a commit in flight named on its lease. Otherwise the catalog is missing
   published versions -- lost, stale, restored from a backup, damaged -- and
   its idea of what is referenced cannot be trusted: the run is refused.
3. **Circuit breaker.** Objects of packs the catalog does not know at all may
   be at most ``max(16, 10%)`` of a location's objects; more is refused.

``force=True`` (``gc --force``) overrides 2 and 3, never 1.

Then, object by object, after the mark: a pack object (one the sweep
dropped from the catalog, or an orphan no catalog row names) is deleted only
if none of the chunks its footer lists is referenced by a visible version
(the mark, built from verified manifests) -- unless the catalog holds that
chunk in another pack whose own footer lists it (a repacked or duplicate
copy). A pack whose footer cannot be read at all (truncated, too few data
shards) serves no chunk and may go; one that cannot be read *now* (a
storage error) stays for a later run. A stale copy of a pack the catalog
knows (a shard repair moved) goes only while the catalog's own shard at
that index is ``ok`` and present at its size, and never while the catalog
names that very object (a repair may have moved the shard back onto the
stale copy's key since the listing); a repair recording it between this
judgement and the delete is caught by :meth:`DeletionGuard.recheck_superseded`,
which marks the shard missing for repair. An orphan manifest goes only if
it is tombstoned.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from casckpt.catalog import PackLayout, ShardRow
from casckpt.catalog import gc as sql
from casckpt.catalog import shards as shard_sql
from casckpt.engine.context import EngineContext
from casckpt.engine.locations import identity
from casckpt.engine.locations.discovery import FoundPack, pack_layout, read_footer, scan_packs
from casckpt.engine.maintenance.scrub import IN_MEMORY_LIMIT
from casckpt.errors import CorruptPackError, GCRefusedError, MissingDataError, StorageError
from casckpt.format import objectnames
from casckpt.format.pack import PackEntry, read_index
from casckpt.storage import BlobInfo
from casckpt.storage.locations import Location

log = logging.getLogger(__name__)

BREAKER_FRACTION = 0.10
BREAKER_MIN = 16

Listing = list[tuple[Location, BlobInfo]]
Object = tuple[int, str]  # (location id, object name)


@dataclass(slots=True)
class Verdicts:
    """Objects cleared for deletion, and why others were kept."""

    delete: list[Object] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


class DeletionGuard:
    """The checks above, for one GC run. Not thread-safe."""

    def __init__(self, ctx: EngineContext, listing: Listing, *, force: bool) -> None:
        self._ctx = ctx
        self._listing = listing
        self._force = force
        self._footers: dict[str, set[str] | None] = {}  # catalog pack -> chunk ids in its footer
        self._by_pack: dict[str, FoundPack] | None = None  # every listed pack object, by pack
        self._removed: set[Object] = set()  # objects this run deleted
        self._stale: dict[str, set[Object]] = {}  # known pack -> its stale objects cleared to go

    # -- before anything changes ------------------------------------------------

    def refuse_unsafe_run(self, floor: float) -> None:
        """Checks 1-3 of the module docstring.

        Raises:
            GCRefusedError: a check failed (the message says which and what to do).
        """
        identity.require_match(self._ctx.catalog, self._ctx.locations)
        unknown = self._unknown_manifests()
        if unknown and not self._force:
            shown = ", ".join(sorted(unknown)[:5]) + (" ..." if len(unknown) > 5 else "")
            raise GCRefusedError(
                f"gc deletes nothing: {len(unknown)} manifest(s) on the blob locations are versions "
                f"the catalog does not know ({shown}). The catalog is missing published versions "
                "(restored from an old backup, partly rebuilt, or damaged), so what it thinks is "
                "garbage may be their data. Run `casckpt check` to see them; rebuild the catalog "
                "from the locations (`casckpt catalog rebuild` into a new, empty catalog) to get "
                "them back; or, if they are leftovers you mean to lose, `casckpt gc --force`.")
        self._breaker(floor)

    def _unknown_manifests(self) -> set[str]:
        """Listed manifests that are not versions, tombstones or a lease's version. No age
        exempts one: a commit names its version on its lease before it writes the manifest, so
        one in flight is known -- and an old lease carried in by a stale catalog backup must not
        excuse the manifests written since."""
        ids = {v for _, info in self._listing if (v := objectnames.version_of(info.key)) is not None}
        return ids - sql.known_manifests(self._ctx.catalog, ids)

    def _breaker(self, floor: float) -> None:
        known = sql.known_pack_ids(self._ctx.catalog)
        total: dict[int, int] = {}
        unknown: dict[int, int] = {}
        for loc, info in self._listing:
            total[loc.id] = total.get(loc.id, 0) + 1
            named = objectnames.pack_of(info.key)
            if named is not None and named[0] not in known and info.mtime <= floor:
                unknown[loc.id] = unknown.get(loc.id, 0) + 1
        for loc in self._ctx.locations.all:
            count = unknown.get(loc.id, 0)
            if count > max(BREAKER_MIN, BREAKER_FRACTION * total.get(loc.id, 0)) and not self._force:
                raise GCRefusedError(
                    f"gc deletes nothing: {count} of the {total[loc.id]} objects on blob location "
                    f"{loc.describe()} belong to packs the catalog does not know, more than the "
                    f"{BREAKER_FRACTION:.0%} gc deletes as orphans in one run. Is this the "
                    "store's catalog? Run `casckpt check` first; `casckpt gc --force` deletes "
                    "them if they are really garbage (e.g. after many killed commits).")

    # -- object by object, after the mark ---------------------------------------

    def dead_packs(self, layouts: Sequence[PackLayout]) -> Verdicts:
        """Which objects of packs the sweep dropped from the catalog may go."""
        out = Verdicts()
        for layout in layouts:
            self._judge(layout, [(sh.location_id, sh.key) for sh in layout.shards], out)
        return out

    def orphans(self, candidates: Sequence[tuple[Location, BlobInfo]],
                removed: Collection[Object] = ()) -> Verdicts:
        """Which listed objects no catalog row names may go (see the module docstring);
        ``removed``: objects this run deleted already (not read again)."""
        out = Verdicts()
        self._removed = set(removed)
        tombstoned = sql.tombstoned_ids(self._ctx.catalog)
        packs: dict[str, FoundPack] = {}
        for loc, info in candidates:
            if (version_id := objectnames.version_of(info.key)) is not None:
                if version_id in tombstoned:
                    out.delete.append((loc.id, info.key))
                else:
                    out.kept.append(f"{info.key} on {loc.name}: a manifest the catalog does not know")
                continue
            named = objectnames.pack_of(info.key)
            if named is None:
                continue
            found = packs.setdefault(named[0], FoundPack())
            if named[1] is None:
                found.copies.append((loc, info.key, info.size))
            else:
                found.shards[named[1]] = (loc, info.key, info.size)
        known = shard_sql.layouts(self._ctx.catalog, packs)
        for pack_id, found in packs.items():
            objects = [(loc.id, key) for loc, key, _ in found.copies] + \
                      [(loc.id, key) for loc, key, _ in found.shards.values()]
            if pack_id in known:
                self._superseded(known[pack_id], found, out)
                continue
            layout = self._full_layout(pack_id)
            if layout is None:
                out.delete.extend(objects)  # no header names a pack: nothing can be read from them
            else:
                self._judge(layout, objects, out)
        return out

    def _full_layout(self, pack_id: str) -> PackLayout | None:
        """An unknown pack's layout from every object of it listed (other shards included)."""
        if self._by_pack is None:
            self._by_pack = scan_packs((loc, info) for loc, info in self._listing
                                       if (loc.id, info.key) not in self._removed)
        return pack_layout(pack_id, self._by_pack.get(pack_id, FoundPack()))

    def _superseded(self, layout: PackLayout, found: FoundPack, out: Verdicts) -> None:
        """Stale copies of a pack the catalog knows go while the catalog's own object for the
        same shard (or a copy) is healthy and present. An object the catalog names now is
        never stale: a repair or heal may have written the shard back at that key since the
        listing (it had been listed as a stale copy, with the stale copy's old mtime)."""
        current = {(sh.location_id, sh.key) for sh in layout.shards}
        healthy = {sh.index for sh in layout.shards if sh.state == "ok" and self._present(sh)}
        stale: list[Object] = []
        for loc, key, _ in found.copies:
            if (loc.id, key) in current:
                continue
            if layout.scheme != "ec" and healthy:
                stale.append((loc.id, key))
            else:
                out.kept.append(f"{key} on {loc.name}: the catalog's copies of its pack are not healthy")
        for index, (loc, key, _) in found.shards.items():
            if (loc.id, key) in current:
                continue
            if index in healthy:
                stale.append((loc.id, key))
            else:
                out.kept.append(f"{key} on {loc.name}: the catalog's shard {index} of its pack is "
                                "not healthy; run `casckpt repair`")
        out.delete.extend(stale)
        self._stale[layout.id] = set(stale)

    def _present(self, shard: ShardRow) -> bool:
        """Whether the catalog's object for a shard is there, at its recorded size (one size
        request; a location that cannot answer counts as not healthy)."""
        loc = self._ctx.locations.get(shard.location_id)
        if loc is None or not loc.readable:
            return False
        try:
            return loc.blobs.size(shard.key) == shard.size
        except StorageError:
            return False

    def recheck_superseded(self, deleted: Collection[Object]) -> list[str]:
        """After deleting stale copies: any the catalog names now (a repair recorded it between
        the check above and the delete) is marked missing, so reads reconstruct it and
        ``repair`` writes it again. Returns what was found, for the report."""
        notes = []
        gone = set(deleted)
        packs = [pack_id for pack_id, stale in self._stale.items() if stale & gone]
        for pack_id, layout in shard_sql.layouts(self._ctx.catalog, packs).items():
            deleted_stale = gone & self._stale[pack_id]
            hit = {sh.index: ("missing", sh.location_id, sh.key) for sh in layout.shards
                   if (sh.location_id, sh.key) in deleted_stale}
            if hit:
                shard_sql.mark_shards(self._ctx.catalog, pack_id, hit)
                self._ctx.packs.layouts.forget(pack_id)
                log.error("gc deleted shard(s) %s of pack %s that a concurrent repair had just "
                          "written back; marked missing (run `casckpt repair`)", sorted(hit), pack_id)
                notes.append(f"pack {pack_id}: shard(s) {sorted(hit)} written back by a concurrent "
                             "repair while gc deleted their stale copies; run `casckpt repair`")
        return notes

    def _judge(self, layout: PackLayout, objects: list[Object], out: Verdicts) -> None:
        try:
            entries = self._entries(layout)
        except (CorruptPackError, MissingDataError):
            out.delete.extend(objects)  # no chunk can be read from it, even reconstructed: it serves nothing
            return
        except StorageError as exc:
            out.kept.extend(f"{key}: cannot be read now ({exc}); a later gc decides" for _, key in objects)
            return
        needed = self._needed(entries, layout.id)
        if needed:
            out.kept.extend(
                f"{key}: holds {len(needed)} chunk(s) versions need that the catalog has in no "
                f"other pack (e.g. {needed[0]}); run `casckpt check`" for _, key in objects)
            log.error("gc kept pack %s: it holds chunks versions need that the catalog lacks (%s)",
                      layout.id, ", ".join(needed[:3]))
            return
        out.delete.extend(objects)

    def _entries(self, layout: PackLayout) -> list[PackEntry]:
        """A pack's footer: read by range, or -- an erasure-coded pack missing a data shard --
        from the pack reconstructed out of any K healthy shards, as a catalog rebuild or a repair would.

        Raises:
            MissingDataError, CorruptPackError: no footer can be had, the pack serves nothing.
            StorageError: a read failed in a way that may not last.
        """
        try:
            return read_footer(self._ctx.locations, layout)
        except MissingDataError:
            if layout.scheme != "ec" or len(layout.shards) < layout.k:
                raise
        if sum(sh.size for sh in layout.shards) > IN_MEMORY_LIMIT:
            raise StorageError(f"pack {layout.id} claims {layout.size} bytes, more than gc reconstructs "
                               "in memory to read its footer")
        data, _ = self._ctx.packs.verifier.read_detached(layout)
        if data is None:
            raise MissingDataError(f"pack {layout.id}: too few healthy shards to rebuild it")
        return read_index(data)

    def _needed(self, entries: Sequence[PackEntry], pack_id: str) -> list[str]:
        """Chunks of this pack versions reference that no other catalog pack verifiably holds."""
        marked = sql.marked(self._ctx.catalog, [e.chunk_id.hex() for e in entries])
        if not marked:
            return []
        rows = self._ctx.catalog.find_chunks(marked, live_only=False)
        return sorted(cid for cid in marked
                      if (row := rows.get(cid)) is None or row.pack_id == pack_id
                      or cid not in self._footer_of(row.pack_id))

    def _footer_of(self, pack_id: str) -> set[str]:
        if pack_id not in self._footers:
            layout = shard_sql.layouts(self._ctx.catalog, [pack_id]).get(pack_id)
            try:
                chunks = {e.chunk_id.hex() for e in read_footer(self._ctx.locations, layout)} \
                    if layout is not None else None
            except (CorruptPackError, MissingDataError, StorageError) as exc:
                log.warning("gc: cannot read the footer of pack %s: %s", pack_id, exc)
                chunks = None
            self._footers[pack_id] = chunks
        return self._footers[pack_id] or set()

"""Putting a pack's shards right: heal (write damaged shards again) and repair.

**Heal** writes shards again from the verified pack: on read, the damaged
shards a reader met; in ``repair``, every shard not ``ok``, on a location not
active, or sharing a failure domain while another is free.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from casckpt.catalog import Catalog, PackLayout
from casckpt.catalog import shards as sql
from casckpt.catalog.leases import begin_lease, release_lease
from casckpt.engine.packlayer.packcoding import ErasureCoder
from casckpt.engine.packlayer.packlayouts import Layouts
from casckpt.engine.packlayer.packplacement import Placement
from casckpt.engine.packlayer.packverify import PackVerifier
from casckpt.errors import StorageError
from casckpt.storage.erasure import DEFAULT_ALGORITHM, Redundancy
from casckpt.storage.locations import CurrentLocations, LocationSet

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RepairOutcome:
    """What repairing (or healing) one pack did."""

    pack_id: str
    rewritten: tuple[tuple[int, str, str], ...]  # (shard, from location, to location)
    unplaced: tuple[int, ...]  # shards no suitable location could take
    error: str | None = None


class PackRepairer:
    """Heals and repairs packs' shards. Thread-safe; concurrent heals of one pack are safe
    (each replaces the rows it wrote; a later reader sees one or the other, both healthy)."""

    def __init__(self, catalog: Catalog, locations: CurrentLocations, layouts: Layouts,
                 coder: ErasureCoder, placement: Placement, verifier: PackVerifier) -> None:
        self._catalog = catalog
        self._locations = locations
        self._layouts = layouts
        self._coder = coder
        self._placement = placement
        self._verifier = verifier

    def heal(self, layout: PackLayout, data: bytes, indexes: Sequence[int],
             fragments: dict[int, bytes] | None = None) -> RepairOutcome:
        """Write shards ``indexes`` again from the verified pack ``data``.

        A shard goes back to its own location when that is active; otherwise
        to an active location in a failure domain no other shard of the pack
        uses. The catalog is updated after the write. A moved shard's old
        object is left where it was: GC deletes it as an orphan after its
        grace period, so readers holding the old layout keep working.
        Holds a commit lease, so a concurrent GC never takes the new objects
        for orphans before the catalog knows them; when GC removed the pack
        meanwhile, the objects just written are deleted again.

        Raises:
            StorageError: the catalog cannot be reached (shards already written are
                orphans for GC). A location refusing a shard is not an error: the
                shard is reported in ``unplaced``.
        """
        lease = begin_lease(self._catalog)
        try:
            return self._heal_leased(self._locations.get(), layout, data, indexes, fragments)
        finally:
            release_lease(self._catalog, lease, f"the repair of pack {layout.id}")

    def _heal_leased(self, locations: LocationSet, layout: PackLayout, data: bytes,
                     indexes: Sequence[int], fragments: dict[int, bytes] | None) -> RepairOutcome:
        payloads = self._coder.payloads_from_fragments(layout, indexes, fragments or {})
        if payloads is None:
            _, payloads = self._coder.encode(layout.id, data, Redundancy(layout.scheme, layout.k, layout.m),
                                             layout.algorithm or DEFAULT_ALGORITHM, only=indexes)
        keep = [sh for sh in layout.shards if sh.index not in indexes]
        taken = {loc.domain for sh in keep if (loc := locations.get(sh.location_id)) is not None
                 and loc.state != "failed"}
        rewritten, unplaced, new_rows = [], [], []
        placement = locations.placement(layout.id)
        for index in indexes:
            old = layout.shard(index)
            old_loc = locations.get(old.location_id) if old is not None else None
            order = ([old_loc] if old_loc is not None and old_loc.state == "active" else []) + \
                [loc for loc in placement if loc is not old_loc]
            done = self._placement.place_one(layout, index, payloads[index], order, taken)
            if done is None:
                unplaced.append(index)
                continue
            new_rows.append(done)
            taken.add(locations.get(done.location_id).domain)  # type: ignore[union-attr]
            rewritten.append((index, old_loc.name if old_loc else "?",
                              locations.get(done.location_id).name))  # type: ignore[union-attr]
        if new_rows:
            self._layouts.forget(layout.id)
            if not sql.replace_shards(self._catalog, layout.id, new_rows):  # GC removed the pack
                locations.delete([(row.location_id, row.key) for row in new_rows])
                return RepairOutcome(layout.id, (), ())
            sql.mark_pack_found(self._catalog, layout.id)
        return RepairOutcome(layout.id, tuple(rewritten), tuple(unplaced))

    def repair(self, pack_id: str) -> RepairOutcome:
        """Heal this pack's shards that are not ``ok`` or sit on a location not active, and
        spread shards that share a failure domain once another domain is free. Idempotent:
        a pack with nothing to put right is left alone.

        Raises:
            BlobNotFoundError: the pack is not in the catalog.
        """
        layout = self._layouts.require(pack_id, fresh=True)
        locations = self._locations.get()
        bad = [sh.index for sh in layout.shards if sh.state != "ok"
               or (loc := locations.get(sh.location_id)) is None or loc.state != "active"]
        bad += self._placement.doubled(layout, bad, locations)
        if not bad:
            return RepairOutcome(pack_id, (), ())
        try:
            found = self._verifier.examine(pack_id, read_all=False)
            if found.data is None:
                found = self._verifier.examine(pack_id, read_all=True)
        except StorageError as exc:
            return RepairOutcome(pack_id, (), tuple(bad), str(exc))
        if found.data is None and found.unreachable:
            return RepairOutcome(pack_id, (), tuple(bad), (
                f"{len(found.healthy)} healthy shard(s) and {len(found.unreachable)} unreachable, "
                f"{layout.k} needed: left alone (nothing rewritten); run repair again once "
                "the storage can be reached"))
        if found.data is None:
            return RepairOutcome(pack_id, (), tuple(bad), (
                f"{len(found.healthy)} healthy shard(s), {layout.k} needed: the pack is lost"))
        layout = self._layouts.require(pack_id, fresh=True)
        bad = sorted(set(bad) | {sh.index for sh in layout.shards if sh.state != "ok"})
        return self.heal(layout, found.data, bad, found.fragments)

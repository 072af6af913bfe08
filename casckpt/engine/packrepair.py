"""Rewriting a pack's shards: heal on read, repair, spreading doubled-up shards.

Functions over a :class:`~casckpt.engine.packstore.PackStore` (kept apart so
each module stays one responsibility: placing and reading packs there,
putting damaged ones right here).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from casckpt.catalog import PackLayout, ShardRow
from casckpt.catalog import shards as sql
from casckpt.catalog.leases import begin_lease, end_lease
from casckpt.errors import CorruptPackError, StorageError
from casckpt.format.shard import ShardHeader, encode_shard_header, payload_checksum
from casckpt.storage.erasure import DEFAULT_ALGORITHM, Redundancy
from casckpt.storage.locations import Location

if TYPE_CHECKING:
    from casckpt.engine.packstore import PackStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ShardPayload:
    """One object of a pack to write: a copy, or a shard (header + fragment) and its checksum."""

    data: bytes | memoryview
    checksum: str | None


@dataclass(frozen=True, slots=True)
class RepairOutcome:
    """What repairing one pack did."""

    pack_id: str
    rewritten: tuple[tuple[int, str, str], ...]  # (shard, from location, to location)
    unplaced: tuple[int, ...]  # shards no suitable location could take
    error: str | None = None


def rewrite(store: PackStore, layout: PackLayout, data: bytes, indexes: Sequence[int],
             fragments: dict[int, bytes] | None = None) -> RepairOutcome:
    """Write shards ``indexes`` again from the verified pack ``data``.

    A shard goes back to its own location when that is active; otherwise
    to an active location in a failure domain no other shard of the pack
    uses. The catalog is updated after the write. A moved shard's old
    object is left where it was: GC deletes it as an orphan after its
    grace period, so readers holding the old layout keep working.
    Holds a commit lease, so a concurrent GC never takes the new objects
    for orphans before the catalog knows them.
    """
    lease = begin_lease(store.catalog)
    try:
        return _rewrite_leased(store, layout, data, indexes, fragments)
    finally:
        end_lease(store.catalog, lease)

def _rewrite_leased(store: PackStore, layout: PackLayout, data: bytes, indexes: Sequence[int],
                    fragments: dict[int, bytes] | None) -> RepairOutcome:
    payloads = _from_fragments(store, layout, indexes, fragments or {})
    if payloads is None:
        _, payloads = store._encode(layout.id, data, Redundancy(layout.scheme, layout.k, layout.m),
                                   layout.algorithm or DEFAULT_ALGORITHM, only=indexes)
    keep = [sh for sh in layout.shards if sh.index not in indexes]
    taken = {loc.domain for sh in keep if (loc := store.locations.get(sh.location_id)) is not None
             and loc.state != "failed"}
    rewritten, unplaced, new_rows = [], [], []
    placement = store.locations.placement(layout.id)
    for index in indexes:
        old = layout.shard(index)
        old_loc = store.locations.get(old.location_id) if old is not None else None
        order = ([old_loc] if old_loc is not None and old_loc.state == "active" else []) + \
            [loc for loc in placement if loc is not old_loc]
        done = _write_one(store, layout, index, payloads[index], order, taken)
        if done is None:
            unplaced.append(index)
            continue
        new_rows.append(done)
        taken.add(store.locations.get(done.location_id).domain)  # type: ignore[union-attr]
        rewritten.append((index, old_loc.name if old_loc else "?",
                          store.locations.get(done.location_id).name))  # type: ignore[union-attr]
    if new_rows:
        store.forget(layout.id)
        if not sql.replace_shards(store.catalog, layout.id, new_rows):  # GC removed the pack
            store.delete([(row.location_id, row.key) for row in new_rows])
            return RepairOutcome(layout.id, (), ())
        sql.mark_pack_found(store.catalog, layout.id)
    return RepairOutcome(layout.id, tuple(rewritten), tuple(unplaced))

def _from_fragments(store: PackStore, layout: PackLayout, indexes: Sequence[int],
                    fragments: dict[int, bytes]) -> dict[int, ShardPayload] | None:
    """Shard objects for ``indexes`` from fragments at hand (reconstructing the others),
    each checked against the checksum the catalog recorded; None: encode instead."""
    if layout.scheme != "ec" or len(fragments) < layout.k:
        return None
    code = store._code(layout.k, layout.m, layout.algorithm or DEFAULT_ALGORITHM)
    try:
        have = dict(fragments)
        have.update(code.reconstruct(fragments, [i for i in indexes if i not in have],
                                     f"pack {layout.id}"))
    except CorruptPackError:
        return None
    payloads = {}
    for index in indexes:
        row, fragment = layout.shard(index), have[index]
        checksum = payload_checksum(fragment)
        if row is None or row.checksum != checksum:
            return None
        header = ShardHeader(layout.id, index, layout.k, layout.m, code.algorithm, layout.size,
                             len(fragment), layout.data_offset or 0, checksum)
        payloads[index] = ShardPayload(encode_shard_header(header) + fragment, checksum)
    return payloads

def _write_one(store: PackStore, layout: PackLayout, index: int, payload: ShardPayload,
               order: Sequence[Location], taken: set[str]) -> ShardRow | None:
    """Write one shard: to a failure domain the pack does not use yet if there is one,
    else (too few domains left) to any active location, least used by this pack first."""
    key = store._object_key(layout, index)
    fresh = [loc for loc in order if loc.state == "active" and loc.domain not in taken]
    used: dict[int, int] = {}
    for sh in layout.shards:
        used[sh.location_id] = used.get(sh.location_id, 0) + 1
    holding = {sh.location_id for sh in layout.shards if sh.key == key and sh.index != index}
    doubled = sorted((loc for loc in order if loc.state == "active" and loc.domain in taken
                      and loc.id not in holding),  # copies share a key: one per location
                     key=lambda loc: used.get(loc.id, 0))
    for loc in [*fresh, *doubled]:
        if loc.domain in taken:
            log.warning("pack %s shard %d shares failure domain %s with another shard: no "
                        "unused domain is active", layout.id, index, loc.domain)
        try:
            loc.blobs.put(key, payload.data)
        except StorageError as exc:
            log.warning("pack %s shard %d: %s refused it: %s", layout.id, index, loc.describe(), exc)
            continue
        return ShardRow(index, loc.id, key, len(payload.data), payload.checksum, "ok", time.time())
    return None

def _doubled(store: PackStore, layout: PackLayout, bad: Sequence[int]) -> list[int]:
    """Healthy shards sharing a failure domain with another, as many as free domains can take."""
    seen: set[str] = set()
    extra: list[int] = []
    for sh in layout.shards:
        loc = store.locations.get(sh.location_id)
        if sh.index in bad or loc is None:
            continue
        if loc.domain in seen:
            extra.append(sh.index)
        seen.add(loc.domain)
    free = [d for d in store.locations.domains() if d not in seen]
    return extra[: len(free)]

def repair(store: PackStore, pack_id: str) -> RepairOutcome:
    """Rebuild this pack's shards that are not ``ok`` or sit on a location not active, and
    spread shards that share a failure domain once another domain is free."""
    layout = store._fresh_layout(pack_id)
    bad = [sh.index for sh in layout.shards if sh.state != "ok"
           or (loc := store.locations.get(sh.location_id)) is None or loc.state != "active"]
    bad += _doubled(store, layout, bad)
    if not bad:
        return RepairOutcome(pack_id, (), ())
    try:
        found = store.examine(pack_id, read_all=False)
        if found.data is None:
            found = store.examine(pack_id, read_all=True)
    except StorageError as exc:
        return RepairOutcome(pack_id, (), tuple(bad), str(exc))
    if found.data is None:
        return RepairOutcome(pack_id, (), tuple(bad), (
            f"{len(found.healthy)} healthy shard(s), {layout.k} needed: the pack is lost"))
    layout = store._fresh_layout(pack_id)
    bad = sorted(set(bad) | {sh.index for sh in layout.shards if sh.state != "ok"})
    return rewrite(store, layout, found.data, bad, found.fragments)


"""The re-key map: a copy across chunk-id keys reads from the source only what it cannot name.

Across keys the same bytes have different chunk ids, so a re-keyed copy
(:mod:`casckpt.engine.copying.rekey`) cannot tell from a source id whether the destination
holds those bytes. Each time it commits a version it therefore remembers, in the
destination's catalog (``rekey_map``, :mod:`casckpt.catalog.rekeymap`), the destination's id
of every source chunk it committed; the next copy looks the source's ids up there and reads
only the extents whose chunks it cannot all name at a destination that still holds them.

What a map row holds, and why it tells the destination nothing new: its key is the
destination's own keyed chunk id (:meth:`~casckpt.format.crypto.StoreCrypto.chunk_id`,
domain-separated) of the source store's identity and the source's chunk id, never the source
id itself. A plain source's ids are bare hashes of the bytes; stored as they are in an
encrypted destination they would let anyone holding its catalog confirm a guessed chunk.
Keyed by the destination, a row names a chunk of the destination and a value only someone
holding the destination's key can derive. A plain destination's keys are bare hashes too, of
ids which, for a plain source, are the destination's own ids of those bytes (which its
catalog shows already), and for an encrypted source reveal nothing without the source's key.

What makes a row stale, and what is done about it: the destination no longer holding the
chunk (its gc swept it). A lookup keeps only the ids the destination's catalog shows live
(:func:`plan`); the rest are read from the source and written again. A row never names other
bytes than its source chunk: both ids are content addresses under keys that never change
(a data key lives as long as its store; rotating a master key re-wraps it, and a store made
again has another identity, so a new key prefix). The gc sweep that
removes chunks drops the rows naming them (:func:`casckpt.catalog.gc.sweep`).

What a mapped extent must satisfy (else it is read, as before the map): not packed with
small neighbours (its bytes would include padding and neighbours the destination lays out
anew), no shard of a larger tensor, and cut on the grid the destination cuts on (the
destination's chunk size, with the extent's alignment, and no phase). The destination's
commit plans its extents from the restored state; an extent reused on the map must come out
of that planning with the same tensors, layout, size and grid (:class:`ExtentMatch`), else
the version is read whole and committed again (:class:`Unmapped`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from casckpt.catalog import rekeymap as rekeymap_sql
from casckpt.engine.context import EngineContext
from casckpt.engine.versions.extents import ExtentSource
from casckpt.engine.write.commitchunks import known_chunks
from casckpt.errors import CasckptError
from casckpt.format.chunks import aligned_chunk_size
from casckpt.format.dtypes import element_size
from casckpt.format.manifest import ExtentEntry, Manifest, TensorEntry

__all__ = ["NOTHING", "ExtentMatch", "MapPlan", "Unmapped", "plan", "remember"]

_DOMAIN = b"casckpt rekey-map v1\x00"
_SPAN_ALIGN = 16  # the alignment of an extent several views share (engine/versions/extents.py)


class Unmapped(CasckptError):
    """The destination planned an extent the copy did not read otherwise than the source
    stored it: the version is read whole instead (never raised to a caller of ``copy``)."""


@dataclass(frozen=True, slots=True)
class MapPlan:
    """What a copy of one version takes from the map: the destination's id of each source
    chunk it could name (held there), and the source extents it therefore does not read."""

    ids: dict[bytes, bytes] = field(default_factory=dict)
    skip: frozenset[int] = frozenset()


NOTHING = MapPlan()
"""Read every extent (the fallback)."""


def map_keys(dest: EngineContext, source_store: str, ids: Iterable[bytes]) -> dict[bytes, str]:
    """The map key (hex) of each source chunk id: the destination's keyed id of the source
    store's identity and the id (see module)."""
    prefix = _DOMAIN + source_store.encode() + b"\x00"
    return {cid: dest.crypto.chunk_id(prefix + cid).hex() for cid in ids}


def _grid_kept(manifest: Manifest, chunk_size: int) -> list[int]:
    """The source extents the destination would cut on the same grid (see module)."""
    users: dict[int, list[TensorEntry]] = defaultdict(list)
    for t in manifest.tensors:
        users[t.extent].append(t)
    out = []
    for i, extent in enumerate(manifest.extents):
        tensors = users.get(i, [])
        if not extent.chunks or extent.packed or extent.phase or not tensors:
            continue
        if any(t.is_shard or t.rank is not None for t in tensors):
            continue
        alone = len(tensors) == 1 and not tensors[0].offset and tensors[0].stride is None
        align = element_size(tensors[0].kind, tensors[0].dtype) if alone else _SPAN_ALIGN
        if extent.chunk_size == aligned_chunk_size(chunk_size, align):
            out.append(i)
    return out


def plan(source: EngineContext, dest: EngineContext, manifest: Manifest) -> MapPlan:
    """The extents of the source's ``manifest`` a copy into ``dest`` need not read: every
    chunk of theirs is on the map and live at the destination (its catalog asked, not its
    cache: a swept chunk's bytes are not at hand to write again)."""
    kept = _grid_kept(manifest, dest.config.chunk_size)
    wanted = list(dict.fromkeys(c for i in kept for c in manifest.extents[i].chunks))
    if not wanted or rekeymap_sql.denied(dest.catalog) is not None:
        return NOTHING
    keys = map_keys(dest, source.catalog.store_id, wanted)
    found = rekeymap_sql.lookup(dest.catalog, list(keys.values()))
    named = {cid: bytes.fromhex(found[key]) for cid, key in keys.items() if key in found}
    held = known_chunks(dest, list(set(named.values())), confirm=True)
    ids = {cid: there for cid, there in named.items() if there in held}
    skip = frozenset(i for i in kept if all(c in ids for c in manifest.extents[i].chunks))
    return MapPlan(ids, skip)


def _layout(t: TensorEntry) -> tuple[object, ...]:
    return (t.path, t.kind, t.dtype, t.shape, t.offset, t.stride, t.global_shape, t.global_offset, t.rank)


class ExtentMatch:
    """The destination commit's :data:`~casckpt.engine.write.commit.Mapped`: which of its
    planned extents hold exactly the bytes of a source extent, cut on the same grid; those the
    plan skipped are reused with the mapped ids.

    After the snapshot, :attr:`pairs` holds destination extent index -> source extent index
    for every such extent (read or not), for :func:`remember`.

    Raises (when called):
        Unmapped: an extent the plan skipped did not come out of the planning as stored.
    """

    def __init__(self, manifest: Manifest, mapping: MapPlan, chunk_size: int) -> None:
        self.manifest, self.mapping, self.chunk_size = manifest, mapping, chunk_size
        self.pairs: dict[int, int] = {}

    def __call__(self, entries: Sequence[TensorEntry], sources: Sequence[ExtentSource]
                 ) -> dict[int, ExtentEntry]:
        before = {t.path: t for t in self.manifest.tensors}
        stored: dict[int, set[str]] = defaultdict(set)
        for t in self.manifest.tensors:
            stored[t.extent].add(t.path)
        planned: dict[int, list[TensorEntry]] = defaultdict(list)
        for e in entries:
            planned[e.extent].append(e)
        self.pairs = {}
        for j, group in planned.items():
            olds = [before.get(e.path) for e in group]
            i = olds[0].extent if olds[0] is not None else -1
            if i < 0 or any(o is None or o.extent != i or _layout(o) != _layout(e)
                            for o, e in zip(olds, group, strict=True)):
                continue
            src, extent = sources[j], self.manifest.extents[i]
            size = aligned_chunk_size(self.chunk_size, src.align)
            grid = (src.nbytes, size, src.grid_offset % size, src.packed)
            if {e.path for e in group} == stored[i] and grid == (extent.nbytes, extent.chunk_size,
                                                                 extent.phase, extent.packed):
                self.pairs[j] = i
        reused = {j: i for j, i in self.pairs.items() if i in self.mapping.skip}
        if set(reused.values()) != self.mapping.skip:
            raise Unmapped("the destination planned a skipped extent otherwise")
        ids = self.mapping.ids
        return {j: ExtentEntry(sources[j].nbytes, self.manifest.extents[i].chunk_size,
                               tuple(ids[c] for c in self.manifest.extents[i].chunks), 0)
                for j, i in reused.items()}


def remember(source: EngineContext, dest: EngineContext, manifest: Manifest, match: ExtentMatch,
             committed: Manifest) -> int:
    """Record on the map the destination's id of every chunk of the source extents the commit
    of ``committed`` (the destination's manifest) hashed on the same grid; returns how many
    it recorded (those known already are kept)."""
    pairs: dict[bytes, bytes] = {}
    for j, i in match.pairs.items():
        if i in match.mapping.skip:
            continue  # taken from the map: on it already
        pairs.update(zip(manifest.extents[i].chunks, committed.extents[j].chunks, strict=True))
    if not pairs or rekeymap_sql.denied(dest.catalog) is not None:
        return 0  # a role without the map's rights: warned once, the copy goes on
    keys = map_keys(dest, source.catalog.store_id, pairs)
    rekeymap_sql.record(dest.catalog, {keys[cid]: there.hex() for cid, there in pairs.items()})
    return len(pairs)

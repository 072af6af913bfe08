"""Verifying a pack's shards: read each in full, check it, reconstruct the pack from healthy ones.

A copy must hash to the pack id; a shard's header must name its pack and
index and its payload match the BLAKE3 recorded in the header and the
catalog; the reconstructed pack must hash to its id. Health found is
recorded in the catalog (repair's queue).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from casckpt.catalog import Catalog, PackLayout, ShardRow
from casckpt.catalog import shards as sql
from casckpt.engine.packlayer.packcoding import ErasureCoder
from casckpt.engine.packlayer.packlayouts import Layouts, shard_state_of
from casckpt.errors import CorruptPackError, StorageError
from casckpt.format.chunks import object_id
from casckpt.format.shard import SHARD_HEADER_SIZE, decode_shard_header, payload_checksum
from casckpt.storage.locations import CurrentLocations, LocationSet

UNREACHABLE = "unreachable"  # a read's outcome, never a shard state the catalog records


@dataclass(slots=True)
class ShardCheck:
    """What reading one pack's shards in full found."""

    healthy: list[int] = field(default_factory=list)
    damaged: dict[int, str] = field(default_factory=dict)  # index -> "missing" | "corrupt"
    unreachable: list[int] = field(default_factory=list)  # shards whose location could not be reached
    notes: dict[int, str] = field(default_factory=dict)  # index -> what was wrong
    data: bytes | None = None  # the verified pack, when it could be reconstructed
    fragments: dict[int, bytes] = field(default_factory=dict)  # ec: healthy or reconstructed, by index


def expected_size(layout: PackLayout) -> int:
    """The most bytes one object of this pack may hold: a copy is the whole pack; the shards of
    an erasure-coded pack are all one size (the largest recorded, as a row of a shard never
    written records 0)."""
    if layout.scheme != "ec":
        return layout.size
    return max((sh.size for sh in layout.shards), default=0)


class PackVerifier:
    """Reads a pack's shards in full and verifies them. Thread-safe.

    ``io`` reads shards in parallel; it must not be a pool whose tasks call
    into this object.
    """

    def __init__(self, catalog: Catalog, locations: CurrentLocations, layouts: Layouts,
                 coder: ErasureCoder, io: ThreadPoolExecutor) -> None:
        self._catalog = catalog
        self._locations = locations
        self._layouts = layouts
        self._coder = coder
        self._io = io

    def examine(self, pack_id: str, *, read_all: bool = True) -> ShardCheck:
        """Read shards in full, verify each, and reconstruct the pack from healthy ones.

        ``read_all`` reads every shard (a scrub); otherwise reading stops
        once enough healthy shards are in hand (a reconstruction). Shard health
        found is recorded in the catalog (damaged shards join repair's queue;
        with ``read_all``, a pack that cannot be reconstructed is marked lost and
        one that can, found). Never raises for a damaged shard: it is reported.

        Raises:
            BlobNotFoundError: the pack is not in the catalog.
        """
        layout = self._layouts.require(pack_id)
        locations = self._locations.get()
        result = ShardCheck()
        order = sorted(layout.shards, key=lambda sh: (sh.index >= layout.k, sh.index))
        payloads: dict[int, bytes] = {}

        def read(sh: ShardRow) -> tuple[ShardRow, tuple[bytes | None, str, str]]:
            return sh, _read_shard(locations, layout, sh)

        if read_all:
            checks = list(self._io.map(read, order))
        else:  # K at a time, in parallel, until K are healthy
            checks, queue = [], list(order)
            while queue:
                missing = layout.k - sum(1 for _, (p, _s, _n) in checks if p is not None)
                if missing <= 0:
                    break
                batch, queue = queue[:missing], queue[missing:]
                checks.extend(self._io.map(read, batch))
        for sh, (payload, state, note) in checks:
            if payload is None:
                if state == UNREACHABLE:
                    result.unreachable.append(sh.index)
                else:
                    result.damaged[sh.index] = state
                result.notes[sh.index] = note
            else:
                result.healthy.append(sh.index)
                payloads[sh.index] = payload
        result.data, inconsistent = self._coder.reconstruct(layout, payloads, result.fragments)
        if result.data is None and read_all and layout.scheme == "ec" and len(payloads) >= layout.k:
            inconsistent = set(payloads)  # no K of them decode to the pack
        for index in inconsistent:  # checksums match, content does not: damaged before it was hashed
            result.healthy.remove(index)
            result.damaged[index] = "corrupt"
            result.notes[index] = "shard is intact on disk but inconsistent with the other shards"
        now_damaged = {i: st for i, st in result.damaged.items()
                       if (row := layout.shard(i)) is not None and row.state != st}
        if now_damaged:
            self._layouts.mark_damaged(layout, now_damaged, "; ".join(result.notes[i] for i in now_damaged))
        if result.healthy:
            # a pack reconstructed and verified against its id counts as verified even when some
            # shards were damaged (those are queued for repair): scrubs then move on to others
            sql.mark_verified(self._catalog, pack_id, result.healthy, whole_pack=read_all)
        elif read_all and not result.unreachable:
            sql.mark_verified(self._catalog, pack_id, [], whole_pack=True)  # scrubs move on to others
        if result.data is not None and read_all:
            sql.mark_pack_found(self._catalog, pack_id)
        elif read_all and not result.unreachable:  # a lost pack's chunks stop counting for dedup,
            sql.mark_pack_lost(self._catalog, pack_id)  # so commits write them again
        return result

    def read_detached(self, layout: PackLayout) -> tuple[bytes | None, dict[int, str]]:
        """Read a pack the catalog does not know yet (catalog rebuild): every shard in full,
        verified, and the pack reconstructed and checked against its id. Records nothing.

        Returns:
            (the pack or None, each shard's state: ok / missing / corrupt).
        """
        locations = self._locations.get()
        checks = list(self._io.map(lambda sh: (sh.index, _read_shard(locations, layout, sh)),
                                   layout.shards))
        payloads = {index: p for index, (p, _state, _note) in checks if p is not None}
        states = {index: state for index, (_p, state, _note) in checks if state != UNREACHABLE}
        data, inconsistent = self._coder.reconstruct(layout, payloads, {})
        states.update({index: "corrupt" for index in inconsistent})
        return data, states


def _read_shard(locations: LocationSet, layout: PackLayout, sh: ShardRow) -> tuple[bytes | None, str, str]:
    """Read one shard in full and check it: (payload or None, state, note); the state of a
    shard that could not be reached is :data:`UNREACHABLE` (see :func:`shard_state_of`)."""
    loc = locations.get(sh.location_id)
    if loc is None or not loc.readable:
        return None, "missing", "its location is failed or unknown"
    try:
        data = loc.blobs.get(sh.key, max_size=expected_size(layout))
    except StorageError as exc:
        state = shard_state_of(exc)
        if state == "missing":
            return None, state, f"object {sh.key} is missing from {loc.describe()}"
        if state == "corrupt":
            return None, state, f"object {sh.key} on {loc.describe()} is refused: {exc}"
        return None, UNREACHABLE, f"cannot read from {loc.describe()}: {exc}"
    if layout.scheme != "ec":
        if object_id(data) != layout.id:
            return None, "corrupt", f"copy on {loc.describe()} does not hash to the pack id"
        return data, "ok", ""
    where = f"shard {sh.index} of pack {layout.id} on {loc.describe()}"
    try:
        header = decode_shard_header(data, where)
    except CorruptPackError as exc:
        return None, "corrupt", str(exc)
    payload = memoryview(data)[SHARD_HEADER_SIZE:]
    if (header.pack_id, header.index) != (layout.id, sh.index) or len(payload) != header.payload_len:
        return None, "corrupt", f"{where} holds the wrong shard or is truncated"
    checksum = payload_checksum(payload)
    if checksum != header.checksum or (sh.checksum and checksum != sh.checksum):
        return None, "corrupt", f"{where} fails its checksum (bit rot?)"
    return bytes(payload), "ok", ""

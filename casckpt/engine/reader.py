"""Reads chunks out of packs into destination buffers, verifying every byte.

Chunks are located through the catalog, grouped by pack, sorted by offset and
fetched with coalesced ranged reads (never whole packs unless needed) on the
engine's thread pool. Each chunk is decoded and checked against its id before
it is copied anywhere; a mismatch raises ``CorruptChunkError``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from casckpt.catalog import ChunkLocation
from casckpt.engine.context import EngineContext
from casckpt.errors import BlobNotFoundError, CorruptPackError, IntegrityError, MissingDataError
from casckpt.format.codecs import Codec
from casckpt.format.pack import ENTRY_HEADER_SIZE, PackEntry, decode_split_entry
from casckpt.storage.base import scatter
from casckpt.types import ProgressCallback

Destination = memoryview


@dataclass(frozen=True, slots=True)
class _Range:
    pack_id: str
    key: str
    start: int
    end: int
    chunks: tuple[ChunkLocation, ...]


def _coalesce(locations: Sequence[ChunkLocation], limit: int) -> list[_Range]:
    by_pack: dict[str, list[ChunkLocation]] = {}
    for loc in locations:
        by_pack.setdefault(loc.pack_id, []).append(loc)
    ranges: list[_Range] = []
    for pack_id, locs in by_pack.items():
        locs.sort(key=lambda loc: loc.offset)
        current: list[ChunkLocation] = []
        for loc in locs:
            span_end = loc.offset + loc.entry().span
            if current and (loc.offset != _end(current[-1]) or span_end - current[0].offset > limit):
                ranges.append(_make_range(pack_id, current))
                current = []
            current.append(loc)
        if current:
            ranges.append(_make_range(pack_id, current))
    return ranges


def _end(loc: ChunkLocation) -> int:
    return loc.offset + loc.entry().span


def _make_range(pack_id: str, locs: list[ChunkLocation]) -> _Range:
    return _Range(pack_id, locs[0].pack_key, locs[0].offset, _end(locs[-1]), tuple(locs))


def read_chunks(
    ctx: EngineContext,
    wanted: Mapping[bytes, list[Destination]],
    describe: Callable[[bytes], str],
    progress: ProgressCallback | None = None,
) -> int:
    """Fill every destination of every wanted chunk with its verified raw bytes.

    A pack that vanished mid-read (GC repacked it: its chunks now live in a
    new pack) is handled by locating the chunks again and reading once more.

    Args:
        wanted: chunk id -> byte views to copy the chunk into.
        describe: names what a chunk belongs to, for error messages.

    Returns:
        Bytes read from the blob store.

    Raises:
        MissingDataError: a chunk is unknown to the catalog, or its pack is gone.
        CorruptChunkError: stored bytes fail verification.
    """
    try:
        return _read_once(ctx, wanted, describe, progress)
    except _PackGone:
        return _read_once(ctx, wanted, describe, progress, last_try=True)


@dataclass(slots=True)
class _Slot:
    """Where one chunk's header and payload are read to.

    A RAW payload is read straight into its first destination (then verified
    there): no intermediate buffer, no copy. Encoded payloads need a buffer
    to decode from.
    """

    entry: PackEntry
    pack_id: str
    header: memoryview
    payload: memoryview
    destinations: list[Destination]

    @classmethod
    def of(cls, loc: ChunkLocation, destinations: list[Destination]) -> _Slot:
        entry = loc.entry()
        direct = entry.codec == Codec.RAW and len(destinations[0]) == entry.stored_len
        payload = destinations[0] if direct else memoryview(bytearray(entry.stored_len))
        return cls(entry, loc.pack_id, memoryview(bytearray(ENTRY_HEADER_SIZE)), payload, destinations)


def _decode(plan: Sequence[_Slot]) -> None:
    """Verify each chunk read and copy it to its other destinations."""
    for slot in plan:
        raw = decode_split_entry(slot.header, slot.payload, slot.entry, slot.pack_id)
        for dst in slot.destinations:
            if dst is not slot.payload:
                dst[:] = raw


class _PackGone(Exception):
    """A pack disappeared between locating and reading (internal; triggers one retry)."""


def _read_once(
    ctx: EngineContext, wanted: Mapping[bytes, list[Destination]],
    describe: Callable[[bytes], str], progress: ProgressCallback | None, last_try: bool = False,
) -> int:
    locations = ctx.catalog.find_chunks((cid.hex() for cid in wanted), live_only=False)
    for cid in wanted:
        if cid.hex() not in locations:
            raise MissingDataError(
                f"chunk {cid.hex()} of {describe(cid)} is not in the catalog; the version is "
                "damaged. Run `casckpt check` and restore another version."
            )
    ranges = _coalesce(list(locations.values()), ctx.config.read_coalesce)
    total = sum(r.end - r.start for r in ranges)
    done = 0

    def _unreadable(pack_id: str, exc: MissingDataError) -> MissingDataError:
        """Name what the caller loses with a pack that cannot be read back."""
        hit = sorted({describe(bytes.fromhex(loc.chunk_id)) for loc in locations.values()
                      if loc.pack_id == pack_id})
        return MissingDataError(f"{'; '.join(hit)} cannot be read: {exc}")

    def fetch(r: _Range) -> int:
        plan = [_Slot.of(loc, wanted[loc.entry().chunk_id]) for loc in r.chunks]
        buffers = [view for slot in plan for view in (slot.header, slot.payload)]
        try:
            got = ctx.packs.read_into(r.pack_id, r.start, buffers)
        except BlobNotFoundError as exc:
            if not last_try:
                raise _PackGone() from exc
            raise MissingDataError(
                f"pack {r.pack_id} holding {describe(r.chunks[0].entry().chunk_id)} is missing "
                f"({exc}); restore another version or run `casckpt repair`"
            ) from exc
        except MissingDataError as exc:
            raise _unreadable(r.pack_id, exc) from exc
        try:
            if got < r.end - r.start:
                raise CorruptPackError(
                    f"pack {r.pack_id} ends before byte {r.end}: it is truncated. Run `casckpt check`."
                )
            _decode(plan)
        except IntegrityError:
            if not ctx.packs.can_rebuild(r.pack_id):
                raise
            # a copy or shard is damaged: rebuild the pack from healthy shards (healing them)
            try:
                pack = ctx.packs.recover(r.pack_id)
            except MissingDataError as exc:
                raise _unreadable(r.pack_id, exc) from exc
            scatter(memoryview(pack)[r.start : r.end], buffers)
            _decode(plan)
        return r.end - r.start

    for read in ctx.pool.map(fetch, ranges):
        done += read
        if progress is not None:
            progress("read", done, total)
    return done

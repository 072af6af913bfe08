"""Chunks located and read out of packs, each verified as it lands: the reads under every
restore (:mod:`~casckpt.engine.read.reader` is the entry point).

Chunks are located through the catalog (:func:`locate`, every record checked before it
sizes a buffer or a read), grouped by pack, sorted by offset and planned as coalesced ranges
(never whole packs unless needed), one task each on the engine's thread pool, the calling
thread taking its share (:func:`pool_results`). From local locations a task reads its range
window by window (:data:`_HOT_WINDOW`) and verifies each window right after it lands, while
its bytes are in cache; from remote ones, in one ranged read. A RAW chunk lands in its
destination and is hashed there; an encoded one is decoded into its destination and hashed
there. A mismatch raises ``CorruptChunkError`` (after wiping the chunk from where it
landed), or, for a pack with redundancy, reconstructs the pack and reads the range again
from it.

:func:`read_located` takes another decoder for the chunks of each range (a callable given
the range's :class:`Slot` s, header and payload as read): the delta chain reader
(:mod:`~casckpt.engine.read.deltachains`) reads its chain nodes through it. Thread-safety: a
decoder runs on the pool's threads, several ranges at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import wait
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import numpy as np

from casckpt.catalog import ChunkLocation
from casckpt.engine.context import EngineContext
from casckpt.errors import (
    BlobNotFoundError,
    CorruptChunkError,
    CorruptPackError,
    IntegrityError,
    MissingDataError,
)
from casckpt.format.chunks import ChunkIds
from casckpt.format.codecs import CODECS, decode_into, lookup
from casckpt.format.pack import ENTRY_HEADER_SIZE, PackEntry, check_entry_header, decode_split_entry
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
            span_end = _end(loc)
            if current and (loc.offset != _end(current[-1]) or span_end - current[0].offset > limit):
                ranges.append(_make_range(pack_id, current))
                current = []
            current.append(loc)
        if current:
            ranges.append(_make_range(pack_id, current))
    return ranges


def _end(loc: ChunkLocation) -> int:
    return loc.offset + ENTRY_HEADER_SIZE + loc.stored_len  # PackEntry.span, without building one


def _make_range(pack_id: str, locs: list[ChunkLocation]) -> _Range:
    return _Range(pack_id, locs[0].pack_name, locs[0].offset, _end(locs[-1]), tuple(locs))



@dataclass(slots=True)
class Slot:
    """Where one chunk's header and payload are read to.

    A RAW payload is read straight into its first destination (then verified
    there, while the bytes are still in cache): no intermediate buffer, no copy.
    Encoded payloads need a buffer to decode from: a fresh one, or a piece of the
    reading thread's reused :class:`_Arena`.
    """

    entry: PackEntry
    pack_id: str
    header: memoryview
    payload: memoryview
    destinations: list[Destination]

    @classmethod
    def of(cls, loc: ChunkLocation, wanted: Mapping[bytes, list[Destination]], arena: _Arena | None = None,
           ) -> Slot:
        """The slot of ``loc``'s chunk, read for its destinations in ``wanted``."""
        entry = loc.entry()
        destinations = wanted[entry.chunk_id]
        direct = lookup(entry.codec).stored_as_is and bool(destinations) \
            and len(destinations[0]) == entry.stored_len
        if direct:
            payload = destinations[0]
        elif arena is not None:
            payload = arena.take(entry.stored_len)
        else:  # not zero-filled: a read fills it whole, or fails (a short read is a truncated pack)
            payload = memoryview(np.empty(entry.stored_len, np.uint8))  # type: ignore[arg-type]
        return cls(entry, loc.pack_id, memoryview(bytearray(ENTRY_HEADER_SIZE)), payload, destinations)


class _Arena:
    """One thread's reused payload buffer for the encoded chunks of a read window.

    :meth:`take` hands out consecutive pieces; :meth:`reset` starts the next window over
    the same memory (grown when a window needs more). Only for a decoder that keeps no
    view of a payload past its window (the plain decoder; never the delta reader's).
    """

    def __init__(self) -> None:
        self._buf = np.empty(0, np.uint8)
        self._used = 0

    def reset(self, size: int) -> None:
        if size > self._buf.nbytes or self._buf.nbytes > max(size, _KEEP_MAX):  # never keep more than
            self._buf = np.empty(size, np.uint8)  # _KEEP_MAX past a window that needed more
        self._used = 0

    def take(self, size: int) -> memoryview:
        piece = memoryview(self._buf[self._used : self._used + size])  # type: ignore[arg-type]
        self._used += size
        return piece


_ARENAS = threading.local()
_KEEP_MAX = 16 << 20  # what a thread keeps between windows (the default read_coalesce)


def _arena() -> _Arena:
    arena: _Arena | None = getattr(_ARENAS, "arena", None)
    if arena is None:
        arena = _ARENAS.arena = _Arena()
    return arena


def _decode(ids: ChunkIds, plan: Sequence[Slot]) -> None:
    """Verify each (plain) chunk read and copy it to its other destinations. An encoded chunk
    is decoded straight into its first destination. A chunk that fails is wiped from the
    destination it was read or decoded into before the error is raised: no corrupt byte is
    left looking restored."""
    for slot in plan:
        first = slot.destinations[0] if slot.destinations else None
        try:
            raw = decode_slot(ids, slot, first)
        except IntegrityError:
            if first is not None:
                np.frombuffer(first, dtype=np.uint8).fill(0)
            raise
        for dst in slot.destinations:
            if dst is not raw:
                dst[:] = raw


def decode_slot(ids: ChunkIds, slot: Slot, into: Destination | None, verify: bool = True,
                ) -> memoryview | bytes:
    """The slot's chunk decoded (into ``into`` when it is encoded and ``into`` is given) and
    checked against its id (unless ``verify`` is false: a caller that verifies what it is used for).

    Raises:
        CorruptChunkError: its header, payload or bytes are damaged.
    """
    entry = slot.entry
    if lookup(entry.codec).stored_as_is or into is None:
        return decode_split_entry(slot.header, slot.payload, entry, slot.pack_id, verify=verify, ids=ids)
    check_entry_header(slot.header, entry, slot.pack_id)
    cid = entry.chunk_id.hex()
    try:
        decode_into(entry.codec, slot.payload, entry.raw_len, into)
    except CorruptChunkError as exc:
        raise CorruptChunkError(f"chunk {cid} in pack {slot.pack_id} is corrupt: {exc}",
                                pack_id=slot.pack_id, chunk_id=cid) from exc
    if verify and ids(into) != entry.chunk_id:
        raise CorruptChunkError(
            f"chunk {cid} in pack {slot.pack_id} (offset {entry.offset}) does not match its id: "
            "the stored bytes are corrupt. Restore another version or repair the store.",
            pack_id=slot.pack_id, chunk_id=cid)
    return into


class PackGone(Exception):
    """A pack disappeared between locating and reading (:func:`~casckpt.engine.read.reader.read_chunks`
    locates again and reads once more)."""


def locate(ctx: EngineContext, ids: Iterable[bytes], describe: Callable[[bytes], str],
           ) -> dict[bytes, ChunkLocation]:
    wanted = list(ids)
    found = ctx.catalog.find_chunks((cid.hex() for cid in wanted), live_only=False)
    for cid in wanted:
        if cid.hex() not in found:
            raise MissingDataError(
                f"chunk {cid.hex()} of {describe(cid)} is not in the catalog; the version is "
                "damaged. Run `casckpt check` and restore another version."
            )
        _check_location(found[cid.hex()], cid, describe)
    return {cid: found[cid.hex()] for cid in wanted}


_HEX = frozenset("0123456789abcdef")


def _is_id(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and _HEX.issuperset(value)


def _check_location(loc: ChunkLocation, cid: bytes, describe: Callable[[bytes], str]) -> None:
    """Refuse a catalog record no writer produces before a byte is allocated or read for it:
    its numbers bound every buffer and range the read makes (a forged stored length must not
    allocate petabytes, a forged base id must not reach ``bytes.fromhex``).

    Raises:
        CorruptChunkError: the record is damaged.
    """
    numbers = (loc.offset, loc.stored_len, loc.raw_len, loc.codec)
    sane = all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers) and \
        loc.chunk_id == cid.hex() and _is_id(loc.pack_id) and isinstance(loc.pack_name, str) and \
        (loc.base_id is None or (_is_id(loc.base_id) and loc.base_id != loc.chunk_id))
    codec = CODECS.get(loc.codec) if sane else None  # an unknown id is damage, never a guess
    sane = codec is not None and (loc.base_id is not None) == codec.is_delta and (
        loc.stored_len <= _compress_bound(loc.raw_len) if codec.zstd  # zstd grows data by a little at most
        else loc.stored_len == loc.raw_len)
    if not sane:
        raise CorruptChunkError(
            f"the catalog's record of chunk {cid.hex()} ({describe(cid)}) is damaged (pack "
            f"{str(loc.pack_id)[:64]!r}, offset {loc.offset!r}, lengths {loc.stored_len!r}/{loc.raw_len!r}, "
            f"codec {loc.codec!r}, base {loc.base_id!r}); run `casckpt check` and restore another "
            "version, or rebuild the catalog from the blobs.", chunk_id=cid.hex())


def _compress_bound(raw_len: int) -> int:
    """More than zstd's worst case for ``raw_len`` bytes (ZSTD_compressBound: + raw/256 + 64 KiB)."""
    return raw_len + (raw_len >> 7) + (128 << 10)



def read_located(
    ctx: EngineContext, wanted: Mapping[bytes, list[Destination]], locations: Mapping[bytes, ChunkLocation],
    describe: Callable[[bytes], str], progress: ProgressCallback | None, last_try: bool,
    heal: bool = True, decode: Callable[[Sequence[Slot]], None] | None = None,
) -> int:
    """Read and decode ``wanted`` (located in ``locations``) into their destinations; ``decode``
    replaces the default decoding of each range's slots."""
    if not wanted:
        return 0
    decoder = decode or partial(_decode, ctx.crypto.chunk_id)
    ranges = _coalesce([locations[cid] for cid in wanted], ctx.config.read_coalesce)
    total = sum(r.end - r.start for r in ranges)
    done = 0

    def _unreadable(pack_id: str, exc: MissingDataError) -> MissingDataError:
        """Name what the caller loses with a pack that cannot be read back."""
        hit = sorted({describe(cid) for cid, loc in locations.items() if loc.pack_id == pack_id})
        return MissingDataError(f"{'; '.join(hit)} cannot be read: {exc}")

    hot = _HOT_WINDOW if _local_reads(ctx) else ctx.config.read_coalesce
    reuse = decode is None  # the delta reader keeps views of what it decodes: fresh buffers

    def fetch(r: _Range) -> int:
        arena = _arena() if reuse else None
        plan: list[Slot] = []
        try:
            for window in _windows(r, hot):
                if arena is not None:
                    arena.reset(sum(loc.stored_len for loc in window))
                slots = [Slot.of(loc, wanted, arena) for loc in window]
                plan += slots
                _read_window(r, slots)
                decoder(slots)  # verified while the bytes just read are still in cache
        except IntegrityError:
            if not ctx.packs.reads.can_reconstruct(r.pack_id):
                raise
            # a copy or shard is damaged: reconstruct the pack from healthy shards (healing them)
            try:
                pack = ctx.packs.reads.reconstruct(r.pack_id, heal=heal)
            except MissingDataError as exc:
                raise _unreadable(r.pack_id, exc) from exc
            plan = [Slot.of(loc, wanted) for loc in r.chunks]
            buffers = [view for slot in plan for view in (slot.header, slot.payload)]
            scatter(memoryview(pack)[r.start : r.end], buffers)
            decoder(plan)
        return r.end - r.start

    def _read_window(r: _Range, slots: Sequence[Slot]) -> None:
        start = slots[0].entry.offset
        end = slots[-1].entry.offset + slots[-1].entry.span
        buffers = [view for slot in slots for view in (slot.header, slot.payload)]
        try:
            got = ctx.packs.reads.read_into(r.pack_id, start, buffers, heal=heal)
        except BlobNotFoundError as exc:
            if not last_try:
                raise PackGone() from exc
            raise MissingDataError(
                f"pack {r.pack_id} holding {describe(r.chunks[0].entry().chunk_id)} is missing "
                f"({exc}); restore another version or run `casckpt repair`"
            ) from exc
        except MissingDataError as exc:
            raise _unreadable(r.pack_id, exc) from exc
        if got < end - start:
            raise CorruptPackError(
                f"pack {r.pack_id} ends before byte {end}: it is truncated. Run `casckpt check`."
            )

    for read in pool_results(ctx, fetch, ranges, progress):
        done += read
        if progress is not None:
            progress("read", done, total)
    return done


_HOT_WINDOW = 2 << 20
"""Bytes a range task reads before it verifies them: small enough to be hashed from cache
right after the read (verifying a whole 16 MiB range after reading it was a second pass
from memory), large enough that the per-read cost stays small."""


def _local_reads(ctx: EngineContext) -> bool:
    """Whether every location reads are served from is on this host's file system: reading a
    range window by window then costs a few system calls more, not round trips."""
    return not any(loc.remote for loc in ctx.locations.read_order())


def _windows(r: _Range, size: int) -> Iterator[Sequence[ChunkLocation]]:
    """The range's chunks in consecutive runs of about ``size`` bytes (at least one chunk)."""
    window: list[ChunkLocation] = []
    start = r.start
    for loc in r.chunks:
        if window and _end(loc) - start > size:
            yield window
            window, start = [], loc.offset
        window.append(loc)
    if window:
        yield window


_WAIT_POLL_S = 1.0  # how often a restore waiting for storage says so


_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


def pool_results(ctx: EngineContext, fn: Callable[[_Item], _Result], items: Sequence[_Item],
                 progress: ProgressCallback | None) -> Iterator[_Result]:
    """``ctx.pool.map(fn, items)``, in any order. Without ``progress`` this (the calling)
    thread runs items too, from the end of the list while the pool's workers take them from
    the front: one more reader than the pool has workers, so one is reading while the others
    hash. With ``progress`` it reports instead: while a pack read waits for storage it cannot
    reach, ``progress("wait", seconds waited, retry budget)``."""
    futures = [ctx.pool.submit(fn, item) for item in items]
    try:
        if progress is None:
            for item, future in zip(reversed(items), reversed(futures), strict=True):
                if not future.cancel():  # a worker has it, and every item before it
                    break
                yield fn(item)
        for future in futures:
            if future.cancelled():
                continue
            if progress is None:
                yield future.result()
                continue
            while not future.done():
                wait([future], timeout=_WAIT_POLL_S)
                waited = ctx.packs.reads.waiting_s()
                if waited is not None and not future.done():
                    progress("wait", int(waited), int(ctx.packs.reads.retry_s))
            yield future.result()
    finally:  # a read that failed or was abandoned: the rest are not wanted, and those running
        for future in futures:  # are waited for, so none writes a destination after this returns
            future.cancel()  # (the delta reader's verifying pass writes them again)
        wait(futures)

"""``check --read-data``: read packs back in bounded memory and verify every byte.

A pack is read object by object, in windows of :data:`WINDOW` bytes, never
whole: each copy is hashed against the pack id; each erasure-coded shard's
header is checked and its payload hashed against the checksum the header
and the catalog record, and the data shards' pack bytes, in order, are
hashed against the pack id. On the way, every entry the pack's footer lists
(read first, by range) is decoded and verified against its chunk id as its
bytes go past -- so memory is one window plus the largest entry, whatever
the pack size. Before any object is read its listed size is compared with
the catalog's: a larger object is reported, not read.

Only when a shard turns out damaged is the pack reconstructed in memory from its
healthy shards (:meth:`PackVerifier.examine`, bounded by the pack's recorded
size), which also finds which shard is inconsistent and queues it for repair.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from casckpt.catalog import PackLayout, ShardRow
from casckpt.catalog import shards as shard_sql
from casckpt.engine.context import EngineContext
from casckpt.engine.locations.discovery import read_footer
from casckpt.engine.packlayer.packlayouts import shard_state_of
from casckpt.errors import AccessDeniedError, CasckptError, IntegrityError, StorageError
from casckpt.format.chunks import ChunkIds, object_hasher
from casckpt.format.pack import PackEntry, decode_entry, read_index
from casckpt.format.shard import SHARD_HEADER_SIZE, decode_shard_header, payload_hasher
from casckpt.storage import BlobInfo
from casckpt.storage.locations import Location, LocationSet

WINDOW = 8 << 20
IN_MEMORY_LIMIT = 1 << 30  # shard bytes reconstructed in memory when a pack cannot be streamed whole

Listed = dict[int, dict[str, BlobInfo]]  # location id -> object name -> what a listing said


@dataclass(slots=True)
class PackVerdict:
    """What reading one pack found."""

    ok: bool = False  # the pack's bytes were read back and hash to its id
    read: int = 0  # bytes read
    notes: list[tuple[int | None, str]] = field(default_factory=list)  # (shard index or None, what)
    corrupt_chunks: dict[str, str] = field(default_factory=dict)  # chunk id -> why
    entries: list[PackEntry] = field(default_factory=list)  # the footer, when it could be read
    damaged: dict[int, str] = field(default_factory=dict)  # shard index -> missing | corrupt
    unreachable: set[int] = field(default_factory=set)  # shards whose location could not be reached


class _EntryVerifier:
    """Verifies a pack's entries, in offset order, as the pack's bytes stream past."""

    def __init__(self, entries: list[PackEntry], pack_id: str, ids: ChunkIds) -> None:
        self._ids = ids
        self._entries = sorted(entries, key=lambda e: e.offset)
        self._next = 0
        self._buf = bytearray()
        self._start = 0  # pack offset of self._buf[0]
        self._pos = 0  # pack bytes seen
        self._pack_id = pack_id
        self.hasher = object_hasher()
        self.corrupt: dict[str, str] = {}

    def feed(self, data: bytes | memoryview) -> None:
        self.hasher.update(data)
        self._pos += len(data)
        if self._next >= len(self._entries):
            return
        self._buf += data
        while self._next < len(self._entries):
            entry = self._entries[self._next]
            end = entry.offset + entry.span
            if end > self._pos:
                break
            if entry.base_id is None:  # a delta is verified later, through its base (check.py)
                view = memoryview(self._buf)[entry.offset - self._start : end - self._start]
                try:
                    decode_entry(view, entry, self._pack_id, ids=self._ids)
                except IntegrityError as exc:
                    self.corrupt[entry.chunk_id.hex()] = str(exc)
                finally:
                    view.release()
            self._next += 1
        keep_from = self._entries[self._next].offset if self._next < len(self._entries) else self._pos
        drop = max(0, min(keep_from, self._pos) - self._start)
        del self._buf[:drop]
        self._start += drop

    def finish(self) -> None:
        """Entries the stream never reached (it ended early) count as corrupt."""
        for entry in self._entries[self._next :]:
            self.corrupt.setdefault(entry.chunk_id.hex(), f"chunk {entry.chunk_id.hex()} lies past the "
                                    f"end of what pack {self._pack_id} could be read")
        self._next = len(self._entries)


def _stream(loc: Location, key: str, start: int, length: int, sink: Callable[[bytes], None]) -> int:
    """Read ``[start, start + length)`` of an object in windows into ``sink``; returns bytes read."""
    done = 0
    while done < length:
        data = loc.blobs.get_range(key, start + done, min(WINDOW, length - done))
        if not data:
            break
        sink(data)
        done += len(data)
    return done


class _ShardSink:
    """Takes a shard's payload as it streams: hashes it, and hands the pack bytes a data shard
    holds (``take`` bytes from payload offset ``offset``) to the pack's verifier."""

    def __init__(self, pack: _EntryVerifier | None, offset: int, take: int) -> None:
        self._pack, self._offset, self._take = pack, offset, take
        self.hasher = payload_hasher()
        self.seen = 0
        self.fed = 0

    def feed(self, data: bytes) -> None:
        self.hasher.update(data)
        lo = max(self._offset - self.seen, 0)
        hi = min(self._offset + self._take - self.seen, len(data))
        if self._pack is not None and lo < hi:
            self._pack.feed(memoryview(data)[lo:hi])
            self.fed += hi - lo
        self.seen += len(data)


def _listed_size(listed: Listed, sh: ShardRow) -> int | None:
    info = listed.get(sh.location_id, {}).get(sh.key)
    return None if info is None else info.size


def verify(locations: LocationSet, layout: PackLayout, listed: Listed, ids: ChunkIds) -> PackVerdict:
    """Read one pack back object by object, streamed, and verify it (see the module docstring).

    Needs no catalog and records nothing (``catalog rebuild`` verifies packs the catalog does
    not know yet this way); ``listed`` gives the objects' sizes, ``ids`` hashes a chunk (the
    store's chunk ids). A pack with a damaged data
    shard is not reconstructed here: the verdict says so (``ok`` False, ``damaged``).
    """
    verdict = PackVerdict()
    footer_error: CasckptError | None = None
    try:
        verdict.entries = read_footer(locations, layout)
    except AccessDeniedError:
        raise  # refused, not damaged or missing: stop, naming the right
    except CasckptError as exc:  # a damaged copy or data shard: read from what verifies below
        footer_error = exc
    if layout.scheme == "ec":
        _verify_shards(locations, layout, listed, verdict, ids)
    else:
        _verify_copies(locations, layout, listed, verdict, ids)
    if verdict.ok and not verdict.entries and footer_error is not None:
        verdict.notes.append((None, f"its footer cannot be read: {footer_error}"))
    return verdict


def scrub(ctx: EngineContext, layout: PackLayout, listed: Listed) -> PackVerdict:
    """:func:`verify` a pack the catalog knows, reconstruct it in memory if a shard is damaged, and
    record what was found (shard health, ``verified_at``; a pack that cannot be read is lost)."""
    verdict = verify(ctx.locations, layout, listed, ctx.crypto.chunk_id)
    if not verdict.ok and layout.scheme == "ec":
        _reconstruct_in_memory(ctx, layout, verdict)  # records shard health itself
    else:
        _record(ctx, layout, verdict)
    return verdict


def _usable(locations: LocationSet, layout: PackLayout, sh: ShardRow, listed: Listed,
            want: int, verdict: PackVerdict) -> Location | None:
    """The shard's location when the shard may be read: listed, and no larger than recorded."""
    loc = locations.get(sh.location_id)
    name = f"copy {sh.key}" if layout.scheme != "ec" else f"shard {sh.index} ({sh.key})"
    if loc is None or not loc.readable:
        verdict.notes.append((sh.index, f"{name} is on a failed or unknown location"))
        verdict.damaged[sh.index] = "missing"
        return None
    size = _listed_size(listed, sh) if sh.location_id in listed else None
    if size is None:  # not listed: find out why (gone, or something that is not an object)
        try:
            size = loc.blobs.size(sh.key)
        except StorageError as exc:
            _failed(verdict, sh.index, f"{name} on {loc.describe()}", exc)
            return None
    if size is None:
        verdict.notes.append((sh.index, f"{name} is missing from {loc.describe()}"))
        verdict.damaged[sh.index] = "missing"
        return None
    if size != want:
        verdict.notes.append((sh.index, f"{name} on {loc.describe()} is {size} bytes, {want} expected; "
                              "not read"))
        verdict.damaged[sh.index] = "corrupt"
        return None
    return loc


def _verify_copies(locations: LocationSet, layout: PackLayout, listed: Listed,
                   verdict: PackVerdict, ids: ChunkIds) -> None:
    last: _EntryVerifier | None = None
    for sh in layout.shards:
        loc = _usable(locations, layout, sh, listed, layout.size, verdict)
        if loc is None:
            continue
        if not verdict.entries:  # the first copy's footer was damaged: try this one's
            try:
                verdict.entries = read_footer(locations, replace(layout, shards=(sh,)))
            except AccessDeniedError:
                raise  # refused, not damaged or missing: stop, naming the right
            except CasckptError:
                pass
        check = _EntryVerifier(verdict.entries if not verdict.ok else [], layout.id, ids)
        try:
            verdict.read += _stream(loc, sh.key, 0, layout.size, check.feed)
        except StorageError as exc:
            _failed(verdict, sh.index, f"copy {sh.key} on {loc.describe()}", exc)
            continue
        check.finish()
        if check.hasher.hexdigest() != layout.id:
            verdict.notes.append((sh.index, f"copy {sh.key} on {loc.describe()} does not hash to the pack "
                                  "id (bit rot?)"))
            verdict.damaged[sh.index] = "corrupt"
            last = last or check
            continue
        if not verdict.ok:
            verdict.ok = True
            verdict.corrupt_chunks = check.corrupt  # a pack that hashes right: its footer lies
    if not verdict.ok and last is not None:
        verdict.corrupt_chunks = last.corrupt


def _verify_shards(locations: LocationSet, layout: PackLayout, listed: Listed,
                   verdict: PackVerdict, ids: ChunkIds) -> None:
    pack = _EntryVerifier(verdict.entries, layout.id, ids)
    stripe, offset = layout.stripe or 0, layout.data_offset or 0
    fed = 0  # pack bytes handed to ``pack`` so far (data shards, in order)
    for sh in sorted(layout.shards, key=lambda s: s.index):
        loc = _usable(locations, layout, sh, listed, sh.size, verdict)
        if loc is None:
            continue
        where = f"shard {sh.index} of pack {layout.id} on {loc.describe()}"
        try:
            head = loc.blobs.get_range(sh.key, 0, SHARD_HEADER_SIZE)
            header = decode_shard_header(head, where)
        except AccessDeniedError:
            raise  # refused, not damaged or missing: stop, naming the right
        except StorageError as exc:
            _failed(verdict, sh.index, where, exc)
            continue
        except CasckptError as exc:
            verdict.notes.append((sh.index, str(exc)))
            verdict.damaged[sh.index] = "corrupt"
            continue
        expected = (layout.id, sh.index, sh.size - SHARD_HEADER_SIZE)
        if (header.pack_id, header.index, header.payload_len) != expected:
            verdict.notes.append((sh.index, f"{where} holds the wrong shard or is truncated"))
            verdict.damaged[sh.index] = "corrupt"
            continue
        in_order = sh.index < layout.k and fed == sh.index * stripe
        sink = _ShardSink(pack if in_order else None, offset,
                          min(stripe, layout.size - sh.index * stripe) if in_order else 0)
        try:
            verdict.read += _stream(loc, sh.key, SHARD_HEADER_SIZE, header.payload_len, sink.feed)
        except StorageError as exc:
            _failed(verdict, sh.index, where, exc)
            continue
        fed += sink.fed
        seen, hasher = sink.seen, sink.hasher
        checksum = hasher.hexdigest()
        if seen != header.payload_len or checksum != header.checksum or (
                sh.checksum and checksum != sh.checksum):
            verdict.notes.append((sh.index, f"{where} fails its checksum (bit rot?)"))
            verdict.damaged[sh.index] = "corrupt"
    pack.finish()
    verdict.ok = fed == layout.size and pack.hasher.hexdigest() == layout.id
    verdict.corrupt_chunks = pack.corrupt


def _failed(verdict: PackVerdict, index: int, what: str, exc: StorageError) -> None:
    """A read of ``what`` (a shard or copy) raised ``exc``: damaged when that proves it corrupt
    (its bytes are there but refused, e.g. failing authentication) or missing; else (its
    location could not be reached) unverified and unmarked."""
    state = shard_state_of(exc)
    if state is None:
        verdict.unreachable.add(index)
        verdict.notes.append((index, f"{what} cannot be read: {exc} (unreachable: not verified, not marked)"))
        return
    verdict.damaged[index] = state
    verdict.notes.append((index, f"{what} is damaged: {exc}" if state == "corrupt"
                          else f"{what} cannot be read: {exc}"))


def _reconstruct_in_memory(ctx: EngineContext, layout: PackLayout, verdict: PackVerdict) -> None:
    """A shard is damaged: reconstruct the pack from the healthy ones (in memory) and verify it."""
    try:
        found = ctx.packs.verifier.examine(layout.id, read_all=True)  # records shard health itself
    except AccessDeniedError:
        raise  # refused, not damaged or missing: stop, naming the right
    except CasckptError as exc:
        verdict.notes.append((None, str(exc)))
        verdict.ok = False
        return
    for index, note in found.notes.items():
        if index not in verdict.damaged and index not in verdict.unreachable:
            verdict.notes.append((index, note))
        if index in found.unreachable:
            verdict.unreachable.add(index)
        else:
            verdict.damaged[index] = found.damaged.get(index, "corrupt")
    verdict.ok = found.data is not None
    if found.data is not None and not verdict.entries:
        try:
            verdict.entries = read_index(found.data)
        except CasckptError as exc:
            verdict.notes.append((None, f"its footer cannot be read: {exc}"))
    if found.data is not None and verdict.entries:
        check = _EntryVerifier(verdict.entries, layout.id, ctx.crypto.chunk_id)
        view = memoryview(found.data)
        for start in range(0, len(view), WINDOW):
            check.feed(view[start : start + WINDOW])
        check.finish()
        verdict.corrupt_chunks = check.corrupt


def _record(ctx: EngineContext, layout: PackLayout, verdict: PackVerdict) -> None:
    """Queue damaged shards for repair; stamp the healthy ones verified."""
    damaged = {i: (state, row.location_id, row.key) for i, state in verdict.damaged.items()
               if (row := layout.shard(i)) is not None and row.state != state}
    if damaged and layout.scheme != "none":  # a lone copy has nothing to be repaired from
        shard_sql.mark_shards(ctx.catalog, layout.id, damaged)
        ctx.packs.layouts.forget(layout.id)
    healthy = [sh.index for sh in layout.shards
               if sh.index not in verdict.damaged and sh.index not in verdict.unreachable]
    if verdict.ok:
        shard_sql.mark_verified(ctx.catalog, layout.id, healthy, whole_pack=True)
        shard_sql.mark_pack_found(ctx.catalog, layout.id)
    elif not verdict.unreachable:  # unreached shards may well hold it
        shard_sql.mark_pack_lost(ctx.catalog, layout.id)

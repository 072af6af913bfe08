"""Reads chunks out of packs into destination buffers, verifying every byte.

Chunks are located through the catalog, grouped by pack, sorted by offset and
planned as coalesced ranges (never whole packs unless needed), one task each on
the engine's thread pool, the calling thread taking its share. From local
locations a task reads its range window by window (:data:`_HOT_WINDOW`) and
verifies each window right after it lands, while its bytes are in cache; from
remote ones, in one ranged read. A RAW chunk lands in its destination and is
hashed there; an encoded one is decoded into its destination and hashed there.
A mismatch raises ``CorruptChunkError`` (after wiping the chunk from where it
landed), or, for a pack with redundancy, reconstructs the pack and reads the
range again from it.

Delta-coded chunks need their base chunk's raw bytes, and the base may be a
delta itself. Every chain of the read is located first, all at once (one
catalog query per step down, for all chains). They are then decoded in
windows holding about :data:`DELTA_WINDOW` bytes (wanted raw bytes and the
payloads of their chain nodes): all of a window's chain nodes are read in one
planned pass of coalesced ranges (keyframes decoded as they land, deltas kept
as read), then each tree of chains is decoded by one task on the pool, root
to leaves, so the cost follows the bytes, not the depth. Every wanted chunk is
verified against its id at the end of its chain; any mismatch decodes the
window again level by level with every level verified, which names the
damaged chunk (so a corrupt base is reported by the chunks that need it) and,
with redundancy, reconstructs its pack. Decoded bases several chunks share
stay in a bounded cache for later windows.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
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
from casckpt.format.codecs import (
    CODECS,
    Delta,
    apply_sparse,
    decode_into,
    delta_planes,
    lookup,
    regroup,
    sparse_planes,
    ungroup_into,
)
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


DELTA_WINDOW = 256 << 20  # raw bytes of delta-coded chunks decoded per window
DECODED_BASES = 256 << 20  # raw bytes of decoded bases kept for chunks of later windows
_TREES_PER_TASK = 8 << 20  # raw bytes of delta chains one pool task decodes


def read_chunks(
    ctx: EngineContext,
    wanted: Mapping[bytes, list[Destination]],
    describe: Callable[[bytes], str],
    progress: ProgressCallback | None = None,
    *, heal: bool = True,
) -> int:
    """Fill every destination of every wanted chunk (id -> byte views) with its verified raw
    bytes; returns the bytes read from the blob store. ``describe`` names what a chunk belongs
    to, for error messages.

    A pack that vanished mid-read (GC repacked it: its chunks now live in a
    new pack) is handled by locating the chunks again and reading once more.

    Raises:
        MissingDataError: a chunk is unknown to the catalog, or its pack is gone.
        CorruptChunkError: stored bytes fail verification.
    """
    try:
        return _read_all(ctx, wanted, describe, progress, heal=heal)
    except _PackGone:
        return _read_all(ctx, wanted, describe, progress, last_try=True, heal=heal)


@dataclass(slots=True)
class _Slot:
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
           ) -> _Slot:
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


def _decode(ids: ChunkIds, plan: Sequence[_Slot]) -> None:
    """Verify each (plain) chunk read and copy it to its other destinations. An encoded chunk
    is decoded straight into its first destination. A chunk that fails is wiped from the
    destination it was read or decoded into before the error is raised: no corrupt byte is
    left looking restored."""
    for slot in plan:
        first = slot.destinations[0] if slot.destinations else None
        try:
            raw = _verified(ids, slot, first)
        except IntegrityError:
            if first is not None:
                np.frombuffer(first, dtype=np.uint8).fill(0)
            raise
        for dst in slot.destinations:
            if dst is not raw:
                dst[:] = raw


def _verified(ids: ChunkIds, slot: _Slot, into: Destination | None, verify: bool = True,
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


class _PackGone(Exception):
    """A pack disappeared between locating and reading (internal; triggers one retry)."""


def _locate(ctx: EngineContext, ids: Iterable[bytes], describe: Callable[[bytes], str],
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


def _check_sizes(wanted: Mapping[bytes, list[Destination]], locations: Mapping[bytes, ChunkLocation],
                 describe: Callable[[bytes], str]) -> None:
    """Every destination of a chunk is as long as the catalog says the chunk is."""
    for cid, destinations in wanted.items():
        raw_len = locations[cid].raw_len
        if any(len(d) != raw_len for d in destinations):
            raise CorruptChunkError(
                f"the catalog records chunk {cid.hex()} of {describe(cid)} as {raw_len} bytes, but the "
                f"version's manifest needs {len(destinations[0])}: the catalog is damaged. Run "
                "`casckpt check` and restore another version.", chunk_id=cid.hex())


def _read_all(ctx: EngineContext, wanted: Mapping[bytes, list[Destination]],
              describe: Callable[[bytes], str], progress: ProgressCallback | None,
              last_try: bool = False, heal: bool = True) -> int:
    locations = _locate(ctx, wanted, describe)
    _check_sizes(wanted, locations, describe)
    plain = {cid: dsts for cid, dsts in wanted.items() if not lookup(locations[cid].codec).is_delta}
    done = _read_located(ctx, plain, locations, describe, progress, last_try, heal)
    deltas = [cid for cid in wanted if cid not in plain]
    if deltas:
        reader = _DeltaReader(ctx, locations, describe, last_try, heal)
        done += reader.read({c: wanted[c] for c in deltas})
    return done


class _DeltaReader:
    """Decodes delta chains window by window (see the module docstring)."""

    def __init__(self, ctx: EngineContext, locations: dict[bytes, ChunkLocation],
                 describe: Callable[[bytes], str], last_try: bool, heal: bool) -> None:
        self.ctx, self.locations, self.last_try, self.heal = ctx, dict(locations), last_try, heal
        self.describe_wanted = describe
        self.needed_by: dict[bytes, bytes] = {}  # base -> a wanted chunk that needs it (for messages)
        self.dependents: dict[bytes, int] = {}  # base -> how many deltas of the whole read need it
        self.decoded: OrderedDict[bytes, Rep] = OrderedDict()  # bounded LRU of decoded bases
        self.decoded_bytes = 0

    def describe(self, cid: bytes) -> str:
        user = self.needed_by.get(cid)
        if user is None:
            return self.describe_wanted(cid)
        return f"the delta base {cid.hex()[:12]} of {self.describe_wanted(user)}"

    def read(self, wanted: Mapping[bytes, list[Destination]]) -> int:
        self._locate_chains(wanted)
        return sum(self._window(window) for window in self._windows(wanted))

    def _locate_chains(self, ids: Iterable[bytes]) -> None:
        """Locate every base of every chain ``ids`` need, down to their keyframes: all chains at
        once, one catalog query per step down."""
        frontier, seen = list(ids), set[bytes]()
        while frontier:
            missing: list[bytes] = []
            onward: list[bytes] = []
            for cid in frontier:
                base_hex = self.locations[cid].base_id
                if cid in seen or base_hex is None:
                    continue
                seen.add(cid)
                base = bytes.fromhex(base_hex)
                self.dependents[base] = self.dependents.get(base, 0) + 1
                self.needed_by.setdefault(base, self.needed_by.get(cid, cid))
                (onward if base in self.locations else missing).append(base)
            if missing:
                self.locations.update(_locate(self.ctx, dict.fromkeys(missing), self.describe))
            frontier = onward + missing

    def _windows(self, wanted: Mapping[bytes, list[Destination]]) -> Iterator[dict[bytes, list[Destination]]]:
        """``wanted`` in windows that hold about :data:`DELTA_WINDOW` bytes at once: the wanted
        chunks' raw bytes and the payloads of the chain nodes they need, each counted once."""
        window: dict[bytes, list[Destination]] = {}
        nodes: set[bytes] = set()
        size = 0
        for cid, destinations in wanted.items():
            window[cid] = destinations
            size += self.locations[cid].raw_len
            for node in self._chain(cid, nodes):
                if node not in nodes:
                    nodes.add(node)
                    size += self.locations[node].stored_len
            if size >= DELTA_WINDOW:
                yield window
                window, nodes, size = {}, set(), 0
        if window:
            yield window

    def _chain(self, cid: bytes, known: Container[bytes]) -> list[bytes]:
        """``cid`` and its bases, until a keyframe, a decoded base, or a node in ``known``.

        Raises:
            CorruptChunkError: the chain is longer than any writer makes (a cycle in a damaged
                catalog), or a base is not as long as the delta coded against it.
        """
        chain, seen = [cid], {cid}
        while chain[-1] not in known:
            loc = self.locations[chain[-1]]
            if loc.base_id is None or bytes.fromhex(loc.base_id) in self.decoded:
                break
            base = bytes.fromhex(loc.base_id)
            if self.locations[base].raw_len != loc.raw_len:
                raise CorruptChunkError(
                    f"chunk {chain[-1].hex()} is delta-coded against {base.hex()}, which the catalog "
                    "records with another length: the catalog is damaged. Run `casckpt check --read-data`.",
                    chunk_id=chain[-1].hex())
            if len(chain) > _MAX_CHAIN or base in seen:
                raise CorruptChunkError(
                    f"chunk {cid.hex()} has a delta chain that loops or is longer than {_MAX_CHAIN}: the "
                    "catalog is damaged. Run `casckpt check --read-data`.", chunk_id=cid.hex())
            chain.append(base)
            seen.add(base)
        return chain

    def _window(self, wanted: Mapping[bytes, list[Destination]]) -> int:
        """Decode a window's chains, verifying each wanted chunk once at the end of its chain; on
        any mismatch, decode again level by level verifying every level (which finds the damaged
        chunk and, with redundancy, reconstructs its pack and heals its shards)."""
        try:
            return self._decode_chains(wanted)
        except IntegrityError:
            self.decoded.clear()  # bases decoded on the fast path were not verified
            self.decoded_bytes = 0
            return self._decode_levels(wanted)

    def _decode_chains(self, wanted: Mapping[bytes, list[Destination]]) -> int:
        """The fast path: every chain node of the window read in one planned pass (keyframes decoded
        as they land, deltas kept as read), then each tree of chains decoded by one task on the pool,
        from its root to its leaves, in grouped byte order (see :func:`_apply`)."""
        trees = self._trees(wanted)
        roots: dict[bytes, Rep] = dict(trees.kept)
        deltas: dict[bytes, _Slot] = {}
        lock = threading.Lock()

        def landed(plan: Sequence[_Slot]) -> None:
            for slot in plan:
                entry = slot.entry
                if entry.base_id is None:  # verified through its dependents
                    into = slot.destinations[0] if slot.destinations else None
                    raw = _verified(self.ctx.crypto.chunk_id, slot, into, verify=False)
                    with lock:
                        roots[entry.chunk_id] = (1, np.frombuffer(raw, dtype=np.uint8))
                else:  # its header now (a damaged one reconstructs the pack here); its payload later
                    check_entry_header(slot.header, entry, slot.pack_id)
                    with lock:
                        deltas[entry.chunk_id] = slot

        targets = {cid: [trees.into[cid]] if cid in trees.into else [] for cid in trees.nodes}
        done = _read_located(self.ctx, targets, self.locations, self.describe, None, self.last_try,
                             self.heal, landed)
        decode = partial(self._decode_trees, trees, roots, deltas, wanted)
        for kept in _results(self.ctx, decode, self._batches(roots), None):
            for cid, rep in kept:
                self._remember(cid, rep)
        return done

    def _batches(self, roots: Iterable[bytes]) -> list[list[bytes]]:
        """Tree roots in pool tasks of about :data:`_TREES_PER_TASK` raw bytes (a task per 1 MiB
        chain cost more to hand over than to run)."""
        batches: list[list[bytes]] = [[]]
        size = 0
        for root in roots:
            if size >= _TREES_PER_TASK:
                batches.append([])
                size = 0
            batches[-1].append(root)
            size += self.locations[root].raw_len
        return batches

    def _decode_trees(self, trees: _Trees, roots: Mapping[bytes, Rep], deltas: Mapping[bytes, _Slot],
                      wanted: Mapping[bytes, list[Destination]], batch: Sequence[bytes],
                      ) -> list[tuple[bytes, Rep]]:
        return [kept for root in batch for kept in self._decode_tree(trees, roots, deltas, wanted, root)]

    def _trees(self, wanted: Mapping[bytes, list[Destination]]) -> _Trees:
        """The window's chains as trees rooted at keyframes and at bases decoded in earlier windows."""
        nodes: dict[bytes, None] = {}
        for cid in wanted:
            nodes.update(dict.fromkeys(self._chain(cid, nodes)))
        children: dict[bytes, list[bytes]] = {}
        kept: dict[bytes, Rep] = {}
        for cid in nodes:
            base_hex = self.locations[cid].base_id
            if base_hex is not None:
                base = bytes.fromhex(base_hex)
                children.setdefault(base, []).append(cid)
                if base not in nodes:
                    kept[base] = self.decoded[base]  # held here: remembering others may evict it
        into: dict[bytes, Destination] = {}
        for cid in nodes:  # a keyframe starting one chain of sparse deltas: decoded into its end
            if self.locations[cid].base_id is None and cid not in wanted:
                end = self._sparse_end(cid, children, wanted)
                if end is not None:
                    into[cid] = wanted[end][0]
        return _Trees(list(nodes), children, kept, into)

    def _sparse_end(self, root: bytes, children: Mapping[bytes, list[bytes]],
                    wanted: Mapping[bytes, list[Destination]]) -> bytes | None:
        """The wanted chunk at the end of the one chain from ``root``, if every delta on it is sparse
        (patched in element order, so the chain can be decoded where its end lands)."""
        node = root
        while node not in wanted:
            after = children.get(node, ())
            if len(after) != 1 or self._shared(node) \
                    or lookup(self.locations[after[0]].codec).delta is not Delta.SPARSE:
                return None
            node = after[0]
        return node if wanted[node] else None

    def _decode_tree(self, trees: _Trees, roots: Mapping[bytes, Rep], deltas: Mapping[bytes, _Slot],
                     wanted: Mapping[bytes, list[Destination]], root: bytes) -> list[tuple[bytes, Rep]]:
        """Decode the chains from ``root`` depth first, each wanted chunk verified at its end and
        copied to its destinations; a base that one delta alone needs is patched in place. Returns
        the decoded bases that several deltas of the read need (:meth:`_shared`, in any window), to
        be remembered for later windows."""
        shared = self._shared(root) or root in trees.kept
        kept = [(root, roots[root])] if shared and root not in trees.kept else []
        todo = [(cid, roots[root], not shared) for cid in trees.children[root]]
        while todo:
            cid, base, own = todo.pop()
            slot, after = deltas[cid], trees.children.get(cid, [])
            destinations = wanted.get(cid, [])
            sparse = lookup(slot.entry.codec).delta is Delta.SPARSE
            into = destinations[0] if destinations and not after and (base[0] == 1 or sparse) else None
            rep = _apply(slot, base, into, own)
            if destinations:
                raw = _ungrouped(rep, destinations)
                filled = destinations[0] if rep[0] != 1 or _same_bytes(destinations[0], rep[1]) else None
                if self.ctx.crypto.chunk_id(raw) != cid:
                    raise _chain_mismatch(slot)
                for dst in destinations:
                    if dst is not filled:
                        dst[:] = raw
            shared = self._shared(cid) or bool(destinations)
            if after and shared:
                kept.append((cid, rep))
            todo += [(child, rep, not shared) for child in after]
        return kept

    def _shared(self, base: bytes) -> bool:
        """Whether more than one delta of the whole read needs ``base`` (in this window or a later
        one): it is then neither patched in place nor decoded into a destination, and it is kept
        for the windows after this one."""
        return self.dependents.get(base, 0) > 1

    def _decode_levels(self, wanted: Mapping[bytes, list[Destination]]) -> int:
        """The verifying path: the window's chains read and decoded level by level (keyframes first),
        every level verified inside its read, where a mismatch reconstructs the pack it came from."""
        levels = self._levels(wanted)
        needed = {bytes.fromhex(h) for c in levels if (h := self.locations[c].base_id) is not None}
        reps: dict[bytes, Rep] = {}  # decoded bases of the level being decoded
        done = 0
        for level in range(max(levels.values()) + 1):
            todo = {cid: list(wanted.get(cid, ())) for cid, at in levels.items() if at == level}
            made: dict[bytes, Rep] = {}
            done += _read_located(self.ctx, todo, self.locations, self.describe, None, self.last_try,
                                  self.heal, self._verifier(reps, needed, made))
            for cid, rep in reps.items():  # a base's dependents are all one level up: done with it
                self._remember(cid, rep)
            reps = made
        for cid, rep in reps.items():
            self._remember(cid, rep)
        return done

    def _levels(self, window: Iterable[bytes]) -> dict[bytes, int]:
        """Each chain node's level in the window (0: a keyframe or a base decoded before)."""
        levels: dict[bytes, int] = {}
        for cid in window:  # iteratively: a damaged catalog's chain may be as long as it likes
            chain = self._chain(cid, levels)
            level = levels.setdefault(chain[-1], 0)
            for node in reversed(chain[:-1]):
                level += 1
                levels[node] = level
        return levels

    def _verifier(self, reps: Mapping[bytes, Rep], needed: set[bytes], made: dict[bytes, Rep],
                  ) -> Callable[[Sequence[_Slot]], None]:
        lock = threading.Lock()

        def decode(plan: Sequence[_Slot]) -> None:
            for slot in plan:
                entry = slot.entry
                filled: memoryview | None = slot.payload  # a destination that holds the bytes already
                if entry.base_id is None:
                    raw = decode_split_entry(slot.header, slot.payload, entry, slot.pack_id,
                                             ids=self.ctx.crypto.chunk_id)
                    rep: Rep = (1, np.frombuffer(raw, dtype=np.uint8))
                else:
                    base = reps[entry.base_id] if entry.base_id in reps else self.decoded[entry.base_id]
                    last = entry.chunk_id not in needed and bool(slot.destinations)
                    sparse = lookup(entry.codec).delta is Delta.SPARSE
                    into = slot.destinations[0] if last and (base[0] == 1 or sparse) else None
                    rep = _apply(slot, base, into)
                    raw = _ungrouped(rep, slot.destinations)
                    filled = slot.destinations[0] if slot.destinations and (rep[0] != 1 or into) else None
                    if self.ctx.crypto.chunk_id(raw) != entry.chunk_id:
                        raise _chain_mismatch(slot)
                for dst in slot.destinations:
                    if dst is not filled:
                        dst[:] = raw
                if entry.chunk_id in needed:
                    with lock:
                        made[entry.chunk_id] = rep
        return decode

    def _remember(self, cid: bytes, rep: Rep) -> None:
        size = rep[1].nbytes
        if cid in self.decoded or size > DECODED_BASES:
            return
        self.decoded[cid] = rep
        self.decoded_bytes += size
        while self.decoded_bytes > DECODED_BASES:
            _, old = self.decoded.popitem(last=False)
            self.decoded_bytes -= old[1].nbytes


Rep = tuple[int, np.ndarray]  # a decoded chunk: (group width, its bytes in that grouped order; 1: plain)


@dataclass(frozen=True, slots=True)
class _Trees:
    """One window's delta chains, as trees: the nodes to read, each base's dependents in the
    window, the bases decoded in earlier windows that some of them need (``kept``), and the
    keyframes decoded straight into the destination of the one chain of sparse deltas they
    start (``into``)."""

    nodes: list[bytes]
    children: dict[bytes, list[bytes]]
    kept: dict[bytes, Rep]
    into: dict[bytes, Destination]


def _ungrouped(rep: Rep, destinations: Sequence[Destination]) -> memoryview:
    """A decoded chunk's bytes in element order -- written straight into its first destination."""
    width, data = rep
    if width == 1:
        return memoryview(data)  # type: ignore[arg-type]  # numpy exports the buffer
    out = np.frombuffer(destinations[0], dtype=np.uint8) if destinations else np.empty(data.nbytes, np.uint8)
    return memoryview(ungroup_into(data, width, out))  # type: ignore[arg-type]


def _apply(slot: _Slot, base: Rep, into: Destination | None = None, own: bool = False) -> Rep:
    """A delta slot's chunk in the delta's grouped order: its XOR planes applied to its base.

    With ``into`` (the chunk ends its chain and its base is in element order), the result lands
    in ``into`` in element order: a dense delta's planes are ungrouped straight into it and the
    base XORed there (one pass fewer than regrouping); a sparse delta patches only its changed
    blocks, in element order. A base this delta ``own``s (no one else needs it) is patched or
    XORed in place.
    """
    entry = slot.entry
    check_entry_header(slot.header, entry, slot.pack_id)
    sparse = lookup(entry.codec).delta is Delta.SPARSE
    try:
        if sparse:
            index, blocks = sparse_planes(slot.payload, entry.raw_len)
        else:
            width, planes = delta_planes(entry.codec, slot.payload, entry.raw_len)
    except CorruptChunkError as exc:
        raise CorruptChunkError(f"chunk {entry.chunk_id.hex()} in pack {slot.pack_id} is corrupt: {exc}",
                                pack_id=slot.pack_id, chunk_id=entry.chunk_id.hex()) from exc
    if base[1].nbytes != entry.raw_len:
        raise _chain_mismatch(slot)
    if sparse:
        return _apply_sparse(base, index, blocks, into, own)
    if into is not None and not _same_bytes(into, base[1]):
        out = np.frombuffer(into, dtype=np.uint8)
        if width == 1:
            np.bitwise_xor(planes, base[1], out=out)
        else:
            np.bitwise_xor(ungroup_into(planes, width, out), base[1], out=out)
        return 1, out
    grouped = regroup(base[1], base[0], width)
    mine = (own or grouped is not base[1]) and grouped.flags.writeable
    return width, np.bitwise_xor(planes, grouped, out=grouped if mine else None)


def _apply_sparse(base: Rep, index: np.ndarray, blocks: np.ndarray, into: Destination | None,
                  own: bool) -> Rep:
    plain = regroup(base[1], base[0], 1)
    if into is not None:
        out = np.frombuffer(into, dtype=np.uint8)
        if not _same_bytes(into, plain):  # else the chain was decoded where it ends (_Trees.into)
            out[:] = plain
    elif (own or plain is not base[1]) and plain.flags.writeable:
        out = plain  # the base is this delta's alone (or a fresh regrouped copy): patch it in place
    else:
        out = plain.copy()
    return 1, apply_sparse(out, index, blocks)


def _same_bytes(view: Destination, data: np.ndarray) -> bool:
    """Whether ``data`` is ``view``'s memory (a keyframe decoded into its chain's destination)."""
    return data.nbytes == len(view) and bool(data.ctypes.data == np.frombuffer(view, np.uint8).ctypes.data)


def _chain_mismatch(slot: _Slot) -> CorruptChunkError:
    cid = slot.entry.chunk_id.hex()
    return CorruptChunkError(
        f"chunk {cid} in pack {slot.pack_id}, decoded through its delta chain, does not match its id: "
        "it or one of its bases is corrupt. Run `casckpt check --read-data`, restore another version, "
        "or `casckpt repair`.", pack_id=slot.pack_id, chunk_id=cid)


_MAX_CHAIN = 1024  # no sane chain is this long: a cycle in a damaged catalog


def _read_located(
    ctx: EngineContext, wanted: Mapping[bytes, list[Destination]], locations: Mapping[bytes, ChunkLocation],
    describe: Callable[[bytes], str], progress: ProgressCallback | None, last_try: bool,
    heal: bool = True, decode: Callable[[Sequence[_Slot]], None] | None = None,
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
        plan: list[_Slot] = []
        try:
            for window in _windows(r, hot):
                if arena is not None:
                    arena.reset(sum(loc.stored_len for loc in window))
                slots = [_Slot.of(loc, wanted, arena) for loc in window]
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
            plan = [_Slot.of(loc, wanted) for loc in r.chunks]
            buffers = [view for slot in plan for view in (slot.header, slot.payload)]
            scatter(memoryview(pack)[r.start : r.end], buffers)
            decoder(plan)
        return r.end - r.start

    def _read_window(r: _Range, slots: Sequence[_Slot]) -> None:
        start = slots[0].entry.offset
        end = slots[-1].entry.offset + slots[-1].entry.span
        buffers = [view for slot in slots for view in (slot.header, slot.payload)]
        try:
            got = ctx.packs.reads.read_into(r.pack_id, start, buffers, heal=heal)
        except BlobNotFoundError as exc:
            if not last_try:
                raise _PackGone() from exc
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

    for read in _results(ctx, fetch, ranges, progress):
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


def _results(ctx: EngineContext, fn: Callable[[_Item], _Result], items: Sequence[_Item],
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

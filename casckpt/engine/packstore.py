"""Packs on the store's locations: placement, quorum writes, ranged reads, heal, scrub, repair.

Every pack is stored as shards (see ``storage/erasure.py`` for the schemes):
one copy (``none``), N copies (``replicate``) or K+M erasure-coded shards
(``ec``), on distinct failure domains, each recorded in the catalog.

Write quorum: a pack counts as durable once ``quorum`` of its shards are
(default: one more than a read needs, see :meth:`Redundancy.default_quorum`);
shards whose location refused the write are recorded ``missing`` and
rebuilt by ``repair``. A commit publishes only after all its packs are durable.

Reads go to healthy data shards (or copies), local locations first, by
range. When a read finds a data shard missing or damaged, or a copy
damaged, the pack is rebuilt from any K healthy shards, verified against
its id, and the damaged shards found on the way are written again (heal on
read); those that cannot be are left marked for ``repair``. A copy found
missing is simply skipped for the next one and queued for ``repair``; a
parity shard is only read (and its damage found) when it is needed or by a
scrub (``check --read-data``).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from threading import Lock

from casckpt.catalog import Catalog, PackLayout, ShardRow
from casckpt.catalog import shards as sql
from casckpt.catalog.gc import begin_lease, end_lease
from casckpt.errors import (
    BlobNotFoundError,
    CorruptPackError,
    InvalidArgumentError,
    MissingDataError,
    StorageError,
)
from casckpt.format.chunks import object_id
from casckpt.format.shard import (
    SHARD_HEADER_SIZE,
    ShardHeader,
    decode_shard_header,
    encode_shard_header,
    payload_checksum,
    shard_key,
)
from casckpt.storage.base import scatter
from casckpt.storage.erasure import DEFAULT_ALGORITHM, ErasureCode, Redundancy
from casckpt.storage.locations import Location, LocationSet

log = logging.getLogger(__name__)

_LAYOUT_CACHE = 4096
_SUBSETS_TRIED = 64  # K-subsets tried when shards pass their checksums yet do not decode
_RECOVERED_KEPT = 2  # rebuilt packs kept for the other ranges of one restore (~64 MiB each)


def pack_key(pack_id: str) -> str:
    """The object key of a whole pack (or a copy of it): ``packs/<first 2 hex>/<id>``."""
    return f"packs/{pack_id[:2]}/{pack_id}"


@dataclass(frozen=True, slots=True)
class _Payload:
    """One object of a pack to write: a copy, or a shard (header + fragment) and its checksum."""

    data: bytes | memoryview
    checksum: str | None


@dataclass(slots=True)
class ShardCheck:
    """What reading one pack's shards in full found."""

    healthy: list[int] = field(default_factory=list)
    damaged: dict[int, str] = field(default_factory=dict)  # index -> "missing" | "corrupt"
    notes: dict[int, str] = field(default_factory=dict)  # index -> what was wrong
    data: bytes | None = None  # the verified pack, when it could be rebuilt
    fragments: dict[int, bytes] = field(default_factory=dict)  # ec: healthy or rebuilt, by index


@dataclass(frozen=True, slots=True)
class RepairOutcome:
    """What repairing one pack did."""

    pack_id: str
    rewritten: tuple[tuple[int, str, str], ...]  # (shard, from location, to location)
    unplaced: tuple[int, ...]  # shards no suitable location could take
    error: str | None = None


class PackStore:
    """Stores, reads, verifies and repairs packs. Thread-safe.

    ``io`` runs shard writes and reads in parallel; it must not be a pool
    whose tasks call into this object (the engine's read pool may).
    """

    def __init__(self, catalog: Catalog, locations: LocationSet, io: ThreadPoolExecutor,
                 quorum: int | None = None) -> None:
        self.catalog = catalog
        self.locations = locations
        self._io = io
        self._quorum = quorum
        self._codes: dict[tuple[int, int, str], ErasureCode] = {}
        self._layouts: OrderedDict[str, PackLayout] = OrderedDict()
        self._recovered: OrderedDict[str, bytes] = OrderedDict()
        self._pack_locks: dict[str, Lock] = {}
        self._lock = Lock()

    # -- policy ---------------------------------------------------------------

    def check_redundancy(self, redundancy: Redundancy) -> None:
        """Refuse a scheme the active failure domains cannot hold.

        Raises:
            InvalidArgumentError: fewer active failure domains than shards.
        """
        domains = self.locations.domains()
        if redundancy.shards > len(domains):
            raise InvalidArgumentError(
                f"redundancy {redundancy} puts each pack on {redundancy.shards} failure domains, "
                f"but the store has {len(domains)} with an active location ({', '.join(domains)}); "
                "add locations (`casckpt location add`) or choose a smaller scheme"
            )

    def redundancy_for(self, run: str | None) -> Redundancy:
        """The scheme new packs of ``run`` get: the run's own, else the store's (default none)."""
        spec = sql.run_redundancy(self.catalog).get(run) if run is not None else None
        return Redundancy.parse(spec or sql.store_redundancy(self.catalog) or "none")

    def check_writable(self, redundancy: Redundancy) -> None:
        """Refuse to write when fewer failure domains are active than the write quorum.

        With fewer active domains than shards (a location failed or is
        draining) but at least the quorum, packs are still written: the
        shards that lack a domain of their own double up on others, and a
        warning says so. ``repair`` spreads them again once locations return.

        Raises:
            StorageError: fewer active failure domains than the quorum.
        """
        domains = self.locations.domains()
        if len(domains) < self.quorum(redundancy):
            raise StorageError(
                f"redundancy {redundancy} needs {self.quorum(redundancy)} active failure domains to "
                f"store a pack durably (its write quorum), but only {len(domains)} are active "
                f"({', '.join(domains) or 'none'}); see `casckpt location list`"
            )
        if len(domains) < redundancy.shards:
            log.warning("only %d failure domains are active for %s: some shards of new packs share a "
                        "domain until locations are added or restored", len(domains), redundancy)

    def quorum(self, redundancy: Redundancy) -> int:
        """Shards that must be durable before a pack counts as stored."""
        wanted = self._quorum or redundancy.default_quorum()
        return max(redundancy.needed, min(wanted, redundancy.shards))

    def _code(self, k: int, m: int, algorithm: str) -> ErasureCode:
        with self._lock:
            code = self._codes.get((k, m, algorithm))
            if code is None:
                code = self._codes[(k, m, algorithm)] = ErasureCode(k, m, algorithm)
            return code

    # -- layouts --------------------------------------------------------------

    def layout(self, pack_id: str, *, fresh: bool = False) -> PackLayout | None:
        """The pack's layout (cached; ``fresh`` re-reads the catalog)."""
        with self._lock:
            cached = None if fresh else self._layouts.get(pack_id)
        if cached is not None:
            return cached
        found = sql.layouts(self.catalog, [pack_id]).get(pack_id)
        with self._lock:
            if found is None:
                self._layouts.pop(pack_id, None)
            else:
                self._layouts[pack_id] = found
                self._layouts.move_to_end(pack_id)
                while len(self._layouts) > _LAYOUT_CACHE:
                    self._layouts.popitem(last=False)
        return found

    def forget(self, pack_id: str) -> None:
        """Drop a cached layout (after the catalog changed it)."""
        with self._lock:
            self._layouts.pop(pack_id, None)

    # -- writing --------------------------------------------------------------

    def store(self, pack_id: str, path: Path, size: int, redundancy: Redundancy) -> PackLayout:
        """Make the finished pack file ``path`` durable at quorum; returns its layout.

        ``path`` may be consumed. Raises StorageError when fewer than the
        quorum of shards could be written (nothing is recorded then; the
        shards that were written are orphans for GC).
        """
        key = pack_key(pack_id)
        if redundancy.kind == "none":
            targets = self.locations.placement(pack_id)
            if not targets:
                raise StorageError("no active blob location to store packs on; see `casckpt location list`")
            last: StorageError | None = None
            for loc in targets:
                try:
                    loc.blobs.put_file(key, path)
                    return PackLayout(pack_id, key, size, shards=(ShardRow(0, loc.id, key, size),))
                except StorageError as exc:
                    log.warning("pack %s: location %s refused it: %s", pack_id, loc.describe(), exc)
                    last = exc
            raise StorageError(f"no location accepted pack {pack_id}: {last}") from last
        self.check_writable(redundancy)
        data = path.read_bytes()
        path.unlink(missing_ok=True)
        layout, payloads = self._encode(pack_id, data, redundancy)
        del data  # shards hold every byte now; bound the memory of the packs in flight
        written = self._place(layout, payloads, self.locations.placement(pack_id))
        healthy = self._durable(written)
        if healthy < self.quorum(redundancy):
            for sh in written:
                target = self.locations.get(sh.location_id)
                if sh.state == "ok" and target is not None:
                    _quiet_delete(target, sh.key)
            raise StorageError(
                f"pack {pack_id} is durable on only {healthy} of {redundancy.shards} shards (shards "
                f"sharing a failure domain count once); the write quorum is "
                f"{self.quorum(redundancy)}. Check the locations (`casckpt location list`)"
            )
        return replace(layout, shards=tuple(written))

    def _durable(self, rows: Sequence[ShardRow]) -> int:
        """Written shards, counting the failure domain holding the most of them as one.

        With a shard per domain this is the number written; when shards
        share a domain (too few were active), losing that one domain must
        not take the pack below what the quorum promises.
        """
        per_domain: dict[str, int] = {}
        for sh in rows:
            loc = self.locations.get(sh.location_id)
            if sh.state == "ok" and loc is not None:
                per_domain[loc.domain] = per_domain.get(loc.domain, 0) + 1
        if not per_domain:
            return 0
        return sum(per_domain.values()) - max(per_domain.values()) + 1

    def _encode(self, pack_id: str, data: bytes, redundancy: Redundancy,
                algorithm: str = DEFAULT_ALGORITHM, only: Sequence[int] | None = None,
                ) -> tuple[PackLayout, dict[int, _Payload]]:
        """The objects a pack is stored as, by shard index (only ``only``, if given)."""
        key = pack_key(pack_id)
        wanted = set(range(redundancy.shards) if only is None else only)
        if redundancy.kind != "ec":  # a copy is checked against the pack id itself
            layout = PackLayout(pack_id, key, len(data), redundancy.kind, 1, redundancy.m)
            return layout, {i: _Payload(data, None) for i in sorted(wanted)}
        code = self._code(redundancy.k, redundancy.m, algorithm)
        fragments, stripe, offset = code.encode(data)
        payloads: dict[int, _Payload] = {}
        for index, fragment in enumerate(fragments):
            fragments[index] = b""  # bound peak memory: each fragment is held once
            if index in wanted:
                checksum = payload_checksum(fragment)
                header = ShardHeader(pack_id, index, code.k, code.m, code.algorithm, len(data),
                                     len(fragment), offset, checksum)
                payloads[index] = _Payload(encode_shard_header(header) + fragment, checksum)
            del fragment
        layout = PackLayout(pack_id, key, len(data), "ec", code.k, code.m, code.algorithm, stripe, offset)
        return layout, payloads

    def _object_key(self, layout: PackLayout, index: int) -> str:
        return layout.key if layout.scheme != "ec" else shard_key(layout.id, index)

    def _place(self, layout: PackLayout, payloads: dict[int, _Payload],
               order: Sequence[Location]) -> list[ShardRow]:
        """Write payload ``i`` to ``order[i]`` (distinct failure domains), using spares on refusal.

        With fewer domains than payloads, erasure-coded shards double up (in
        placement order); copies of a pack share one key, so they never do.
        Returns one row per payload: ``ok`` where written, else ``missing``.
        """
        slots = list(order)
        while layout.scheme == "ec" and slots and len(slots) < len(payloads):
            slots += slots[: len(payloads) - len(slots)]
        first, spares = slots[: len(payloads)], slots[len(payloads) :]

        def write(index: int, loc: Location) -> bool:
            try:
                loc.blobs.put(self._object_key(layout, index), payloads[index].data)
                return True
            except StorageError as exc:
                log.warning("pack %s shard %d: location %s refused it: %s",
                            layout.id, index, loc.describe(), exc)
                return False

        results = list(self._io.map(write, range(len(first)), first))
        rows: list[ShardRow] = []
        for index, payload in sorted(payloads.items()):
            loc = first[index] if index < len(first) else None
            ok = results[index] if index < len(first) else False
            while not ok and spares:
                loc = spares.pop(0)
                ok = write(index, loc)
            nominal = loc or order[0]  # a shard never written still names where it belongs
            rows.append(ShardRow(index, nominal.id, self._object_key(layout, index), len(payload.data),
                                 payload.checksum, "ok" if ok else "missing"))
        return rows

    # -- reading --------------------------------------------------------------

    def _must_layout(self, pack_id: str) -> PackLayout:
        layout = self.layout(pack_id)
        if layout is None:
            raise BlobNotFoundError(f"pack {pack_id} is not in the catalog (removed by GC?)")
        return layout

    def _readable(self, layout: PackLayout) -> list[tuple[ShardRow, Location]]:
        """Shards worth reading, best first: healthy, data shards, local locations."""
        out = []
        for sh in layout.shards:
            loc = self.locations.get(sh.location_id)
            if loc is not None and loc.readable and (sh.state == "ok" or layout.scheme == "none"):
                out.append((sh, loc))
        out.sort(key=lambda pair: (pair[0].index >= layout.k, pair[1].remote, pair[0].index))
        return out

    def read_into(self, pack_id: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """Fill ``buffers`` with pack bytes from ``offset``; returns the bytes read.

        Reads copies or data shards by range; falls back to rebuilding the
        pack (:meth:`recover`) when a shard it needs is gone. The caller
        verifies what it reads and calls :meth:`recover` on a mismatch.

        Raises:
            BlobNotFoundError: the pack is not in the catalog (GC removed it).
            MissingDataError, CorruptPackError: too few healthy shards.
        """
        layout = self._must_layout(pack_id)
        if layout.scheme == "ec":
            return self._read_striped(layout, offset, buffers)
        for sh, loc in self._readable(layout):
            try:
                return loc.blobs.read_into(sh.key, offset, buffers)
            except StorageError as exc:
                self._damaged(layout, {sh.index: "missing"}, f"{loc.describe()}: {exc}")
        if layout.scheme == "none":
            raise BlobNotFoundError(
                f"pack {pack_id} is missing from {self._where(layout)}; restore another version, "
                "or add redundancy (`casckpt redundancy`) to survive this")
        return scatter(memoryview(self.recover(pack_id))[offset:], buffers)

    def _read_striped(self, layout: PackLayout, offset: int, buffers: Sequence[memoryview]) -> int:
        stripe, base = layout.stripe or 0, SHARD_HEADER_SIZE + (layout.data_offset or 0)
        want = min(sum(len(b) for b in buffers), max(0, layout.size - offset))
        pieces: list[tuple[ShardRow, Location, int, list[memoryview]]] = []
        rest, pos = list(buffers), offset
        while pos < offset + want:
            index = pos // stripe
            take = min(stripe * (index + 1), offset + want) - pos
            part, rest = _split(rest, take)
            sh = layout.shard(index)
            loc = self.locations.get(sh.location_id) if sh is not None else None
            if sh is None or loc is None or not loc.readable or sh.state != "ok":
                return self._from_recovered(layout, offset, buffers)
            pieces.append((sh, loc, base + pos - index * stripe, part))
            pos += take
        for sh, loc, at, part in pieces:
            try:
                got = loc.blobs.read_into(sh.key, at, part)
            except StorageError as exc:
                self._damaged(layout, {sh.index: "missing"}, f"{loc.describe()}: {exc}")
                return self._from_recovered(layout, offset, buffers)
            if got < sum(len(p) for p in part):
                self._damaged(layout, {sh.index: "corrupt"}, "shard is truncated")
                return self._from_recovered(layout, offset, buffers)
        return want

    def _from_recovered(self, layout: PackLayout, offset: int, buffers: Sequence[memoryview]) -> int:
        return scatter(memoryview(self.recover(layout.id))[offset:], buffers)

    def can_rebuild(self, pack_id: str) -> bool:
        """Whether the pack has redundancy to rebuild a damaged copy or shard from."""
        layout = self.layout(pack_id)
        return layout is not None and layout.scheme != "none"

    def get(self, pack_id: str) -> bytes:
        """The whole pack, verified against its id (rebuilt from shards if it must be).

        Raises:
            BlobNotFoundError: the pack is not in the catalog.
            MissingDataError, CorruptPackError: it cannot be read back intact.
        """
        layout = self._must_layout(pack_id)
        if layout.scheme == "ec":
            buf = bytearray(layout.size)
            self._read_striped(layout, 0, [memoryview(buf)])
            data = bytes(buf)
        else:
            data = b""
            for sh, loc in self._readable(layout):
                try:
                    data = loc.blobs.get(sh.key)
                    break
                except StorageError as exc:
                    self._damaged(layout, {sh.index: "missing"}, f"{loc.describe()}: {exc}")
        if data and object_id(data) == pack_id:
            return data
        if layout.scheme == "none":
            raise (CorruptPackError if data else MissingDataError)(
                f"pack {pack_id} on {self._where(layout)} is "
                f"{'damaged (its bytes do not hash to its id)' if data else 'missing'}; it has no "
                "redundancy to rebuild it from. Run `casckpt check` to list the versions affected")
        return self.recover(pack_id)

    def _where(self, layout: PackLayout) -> str:
        names = [loc.describe() for sh in layout.shards
                 if (loc := self.locations.get(sh.location_id)) is not None]
        return ", ".join(names) or "an unknown location"

    # -- verify, heal, repair ---------------------------------------------------

    def _read_shard(self, layout: PackLayout, sh: ShardRow) -> tuple[bytes | None, str, str]:
        """Read one shard in full and check it: (payload or None, state, note)."""
        loc = self.locations.get(sh.location_id)
        if loc is None or not loc.readable:
            return None, "missing", "its location is failed or unknown"
        try:
            data = loc.blobs.get(sh.key)
        except BlobNotFoundError:
            return None, "missing", f"object {sh.key} is missing from {loc.describe()}"
        except StorageError as exc:
            return None, "missing", f"cannot read from {loc.describe()}: {exc}"
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

    def examine(self, pack_id: str, *, read_all: bool = True) -> ShardCheck:
        """Read shards in full, verify each, and rebuild the pack from healthy ones.

        ``read_all`` reads every shard (a scrub); otherwise reading stops
        once enough healthy shards are in hand (a recovery). Shard health
        found is recorded in the catalog (damaged shards join repair's queue).
        """
        layout = self._must_layout(pack_id)
        result = ShardCheck()
        order = sorted(layout.shards, key=lambda sh: (sh.index >= layout.k, sh.index))
        payloads: dict[int, bytes] = {}
        def read(sh: ShardRow) -> tuple[ShardRow, tuple[bytes | None, str, str]]:
            return sh, self._read_shard(layout, sh)

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
                result.damaged[sh.index] = state
                result.notes[sh.index] = note
            else:
                result.healthy.append(sh.index)
                payloads[sh.index] = payload
        result.data, inconsistent = self._rebuild(layout, payloads, result.fragments)
        if result.data is None and read_all and layout.scheme == "ec" and len(payloads) >= layout.k:
            inconsistent = set(payloads)  # no K of them decode to the pack
        for index in inconsistent:  # checksums match, content does not: damaged before it was hashed
            result.healthy.remove(index)
            result.damaged[index] = "corrupt"
            result.notes[index] = "shard is intact on disk but inconsistent with the other shards"
        now_damaged = {i: st for i, st in result.damaged.items()
                       if (row := layout.shard(i)) is not None and row.state != st}
        if now_damaged:
            self._damaged(layout, now_damaged, "; ".join(result.notes[i] for i in now_damaged))
        if result.healthy:
            # a pack rebuilt and verified against its id counts as verified even when some
            # shards were damaged (those are queued for repair): scrubs then move on to others
            sql.mark_verified(self.catalog, pack_id, result.healthy, whole_pack=read_all)
        elif read_all:
            sql.mark_verified(self.catalog, pack_id, [], whole_pack=True)  # scrubs move on to others
        if read_all:  # a lost pack's chunks stop counting for dedup, so commits write them again
            (sql.mark_pack_found if result.data is not None else sql.mark_pack_lost)(self.catalog, pack_id)
        return result

    def read_detached(self, layout: PackLayout) -> tuple[bytes | None, dict[int, str]]:
        """Read a pack the catalog does not know yet (catalog rebuild): every shard in full,
        verified, and the pack rebuilt and checked against its id.

        Returns (the pack or None, each shard's state: ok / missing / corrupt).
        """
        checks = list(self._io.map(lambda sh: (sh.index, self._read_shard(layout, sh)), layout.shards))
        payloads = {index: p for index, (p, _state, _note) in checks if p is not None}
        states = {index: state for index, (_p, state, _note) in checks}
        data, inconsistent = self._rebuild(layout, payloads, {})
        states.update({index: "corrupt" for index in inconsistent})
        return data, states

    def _rebuild(self, layout: PackLayout, payloads: dict[int, bytes],
                 fragments: dict[int, bytes]) -> tuple[bytes | None, set[int]]:
        """Rebuild the pack from verified payloads: (pack or None, payloads inconsistent with it).

        Fast path: the data fragments at hand, plus the missing ones
        reconstructed (kept in ``fragments`` with the healthy ones, for
        healing). Payloads are checked against their checksums, but one
        damaged before it was hashed would still pass; so when that does
        not give the pack id, all of them are decoded together, then subsets
        of K, and the payloads the winning pack does not re-encode to are reported.
        """
        if not payloads:
            return None, set()
        if layout.scheme != "ec":
            return next(iter(payloads.values())), set()
        if len(payloads) < layout.k:
            return None, set()
        code = self._code(layout.k, layout.m, layout.algorithm or DEFAULT_ALGORITHM)
        fragments.update(payloads)
        try:
            fragments.update(code.reconstruct(
                payloads, [i for i in range(layout.k) if i not in payloads], f"pack {layout.id}"))
            start, stripe = layout.data_offset or 0, layout.stripe or 0
            data = b"".join(memoryview(fragments[i])[start : start + stripe]
                            for i in range(layout.k))[: layout.size]
            if object_id(data) == layout.id:
                return data, set()
        except CorruptPackError:
            pass
        fragments.clear()

        def attempt(subset: dict[int, bytes]) -> bytes | None:
            try:
                data = code.decode(subset, layout.size, f"pack {layout.id}")
            except CorruptPackError:
                return None
            return data if object_id(data) == layout.id else None

        whole = attempt(payloads)
        if whole is not None:
            return whole, set()
        for combo in itertools.islice(itertools.combinations(sorted(payloads), layout.k), _SUBSETS_TRIED):
            whole = attempt({i: payloads[i] for i in combo})
            if whole is not None:
                encoded, _, _ = code.encode(whole)
                return whole, {i for i, p in payloads.items() if p != encoded[i]}
        return None, set()

    def recover(self, pack_id: str) -> bytes:
        """Rebuild a pack from its healthy shards and heal the damaged ones (heal on read).

        Single-flight per pack: restore reads a pack in several ranges at
        once, and all of them wait for one rebuild. The last few rebuilt
        packs are kept (packs are immutable, so they never go stale).

        Raises:
            MissingDataError: too few healthy shards; names the pack and what is wrong.
        """
        with self._lock:
            pack_lock = self._pack_locks.setdefault(pack_id, Lock())
        with pack_lock:
            with self._lock:
                cached = self._recovered.get(pack_id)
            if cached is not None:
                return cached
            try:
                data = self._recover(pack_id)
            except BaseException:
                with self._lock:
                    self._pack_locks.pop(pack_id, None)
                raise
            with self._lock:
                self._recovered[pack_id] = data
                while len(self._recovered) > _RECOVERED_KEPT:
                    old, _ = self._recovered.popitem(last=False)
                    self._pack_locks.pop(old, None)
            return data

    def _recover(self, pack_id: str) -> bytes:
        layout = self.layout(pack_id, fresh=True)
        if layout is None:
            raise BlobNotFoundError(f"pack {pack_id} is not in the catalog (removed by GC?)")
        found = self.examine(pack_id, read_all=False)
        if found.data is None:
            found = self.examine(pack_id, read_all=True)
        if found.data is None:
            sql.mark_pack_lost(self.catalog, pack_id)
            needed = layout.k if layout.scheme == "ec" else 1
            details = "; ".join(f"shard {i}: {n}" for i, n in sorted(found.notes.items()))
            raise MissingDataError(
                f"pack {pack_id} cannot be rebuilt: {len(found.healthy)} healthy shard(s) of "
                f"{len(layout.shards)}, {needed} needed ({details}). Restore another version; "
                "`casckpt check` lists every version affected")
        damaged = [sh.index for sh in self._fresh_layout(pack_id).shards if sh.state != "ok"]
        if damaged:
            try:
                self._rewrite(self._fresh_layout(pack_id), found.data, damaged, found.fragments)
            except StorageError as exc:  # left marked; `casckpt repair` retries
                log.warning("pack %s: healing shards %s failed: %s", pack_id, damaged, exc)
        return found.data

    def _fresh_layout(self, pack_id: str) -> PackLayout:
        layout = self.layout(pack_id, fresh=True)
        if layout is None:
            raise BlobNotFoundError(f"pack {pack_id} is not in the catalog (removed by GC?)")
        return layout

    def _damaged(self, layout: PackLayout, states: dict[int, str], why: str) -> None:
        """Queue shards for repair -- only rows still pointing where this layout looked (another
        process may have moved them) -- and drop the cached layout."""
        self.forget(layout.id)
        if layout.scheme == "none":  # nothing to rebuild it from: the reader reports it
            return
        log.warning("pack %s: shard(s) %s %s (%s); queued for repair", layout.id,
                    sorted(states), "/".join(sorted(set(states.values()))), why)
        rows = {i: (state, row.location_id, row.key) for i, state in states.items()
                if (row := layout.shard(i)) is not None}
        sql.mark_shards(self.catalog, layout.id, rows)

    def _rewrite(self, layout: PackLayout, data: bytes, indexes: Sequence[int],
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
        lease = begin_lease(self.catalog)
        try:
            return self._rewrite_leased(layout, data, indexes, fragments)
        finally:
            end_lease(self.catalog, lease)

    def _rewrite_leased(self, layout: PackLayout, data: bytes, indexes: Sequence[int],
                        fragments: dict[int, bytes] | None) -> RepairOutcome:
        payloads = self._from_fragments(layout, indexes, fragments or {})
        if payloads is None:
            _, payloads = self._encode(layout.id, data, Redundancy(layout.scheme, layout.k, layout.m),
                                       layout.algorithm or DEFAULT_ALGORITHM, only=indexes)
        keep = [sh for sh in layout.shards if sh.index not in indexes]
        taken = {loc.domain for sh in keep if (loc := self.locations.get(sh.location_id)) is not None
                 and loc.state != "failed"}
        rewritten, unplaced, new_rows = [], [], []
        placement = self.locations.placement(layout.id)
        for index in indexes:
            old = layout.shard(index)
            old_loc = self.locations.get(old.location_id) if old is not None else None
            order = ([old_loc] if old_loc is not None and old_loc.state == "active" else []) + \
                [loc for loc in placement if loc is not old_loc]
            done = self._write_one(layout, index, payloads[index], order, taken)
            if done is None:
                unplaced.append(index)
                continue
            new_rows.append(done)
            taken.add(self.locations.get(done.location_id).domain)  # type: ignore[union-attr]
            rewritten.append((index, old_loc.name if old_loc else "?",
                              self.locations.get(done.location_id).name))  # type: ignore[union-attr]
        if new_rows:
            self.forget(layout.id)
            if not sql.replace_shards(self.catalog, layout.id, new_rows):  # GC removed the pack
                self.delete([(row.location_id, row.key) for row in new_rows])
                return RepairOutcome(layout.id, (), ())
            sql.mark_pack_found(self.catalog, layout.id)
        return RepairOutcome(layout.id, tuple(rewritten), tuple(unplaced))

    def _from_fragments(self, layout: PackLayout, indexes: Sequence[int],
                        fragments: dict[int, bytes]) -> dict[int, _Payload] | None:
        """Shard objects for ``indexes`` from fragments at hand (reconstructing the others),
        each checked against the checksum the catalog recorded; None: encode instead."""
        if layout.scheme != "ec" or len(fragments) < layout.k:
            return None
        code = self._code(layout.k, layout.m, layout.algorithm or DEFAULT_ALGORITHM)
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
            payloads[index] = _Payload(encode_shard_header(header) + fragment, checksum)
        return payloads

    def _write_one(self, layout: PackLayout, index: int, payload: _Payload,
                   order: Sequence[Location], taken: set[str]) -> ShardRow | None:
        """Write one shard: to a failure domain the pack does not use yet if there is one,
        else (too few domains left) to any active location, least used by this pack first."""
        key = self._object_key(layout, index)
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

    def _doubled(self, layout: PackLayout, bad: Sequence[int]) -> list[int]:
        """Healthy shards sharing a failure domain with another, as many as free domains can take."""
        seen: set[str] = set()
        extra: list[int] = []
        for sh in layout.shards:
            loc = self.locations.get(sh.location_id)
            if sh.index in bad or loc is None:
                continue
            if loc.domain in seen:
                extra.append(sh.index)
            seen.add(loc.domain)
        free = [d for d in self.locations.domains() if d not in seen]
        return extra[: len(free)]

    def repair(self, pack_id: str) -> RepairOutcome:
        """Rebuild this pack's shards that are not ``ok`` or sit on a location not active, and
        spread shards that share a failure domain once another domain is free."""
        layout = self._fresh_layout(pack_id)
        bad = [sh.index for sh in layout.shards if sh.state != "ok"
               or (loc := self.locations.get(sh.location_id)) is None or loc.state != "active"]
        bad += self._doubled(layout, bad)
        if not bad:
            return RepairOutcome(pack_id, (), ())
        try:
            found = self.examine(pack_id, read_all=False)
            if found.data is None:
                found = self.examine(pack_id, read_all=True)
        except StorageError as exc:
            return RepairOutcome(pack_id, (), tuple(bad), str(exc))
        if found.data is None:
            return RepairOutcome(pack_id, (), tuple(bad), (
                f"{len(found.healthy)} healthy shard(s), {layout.k} needed: the pack is lost"))
        layout = self._fresh_layout(pack_id)
        bad = sorted(set(bad) | {sh.index for sh in layout.shards if sh.state != "ok"})
        return self._rewrite(layout, found.data, bad, found.fragments)

    def delete(self, shards: Sequence[tuple[int, str]]) -> int:
        """Delete shard objects ((location id, key)); returns how many went. Errors are logged."""
        deleted = 0
        for location_id, key in shards:
            loc = self.locations.get(location_id)
            if loc is not None and loc.readable and _quiet_delete(loc, key):
                deleted += 1
        return deleted


def _quiet_delete(loc: Location, key: str) -> bool:
    try:
        loc.blobs.delete(key)
        return True
    except StorageError as exc:
        log.warning("could not delete %s from %s: %s (a later gc removes it)", key, loc.describe(), exc)
        return False


def _split(buffers: list[memoryview], count: int) -> tuple[list[memoryview], list[memoryview]]:
    """Split a buffer list after ``count`` bytes (slicing one buffer if needed)."""
    head: list[memoryview] = []
    for i, buf in enumerate(buffers):
        if count <= 0:
            return head, buffers[i:]
        if len(buf) <= count:
            head.append(buf)
            count -= len(buf)
        else:
            head.append(buf[:count])
            return head, [buf[count:], *buffers[i + 1 :]]
    return head, []


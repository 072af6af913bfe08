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

import logging
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from threading import Lock

from casckpt.catalog import Catalog, PackLayout, ShardRow
from casckpt.catalog import shards as sql
from casckpt.engine import packrepair, packverify
from casckpt.engine.packrepair import RepairOutcome, ShardPayload
from casckpt.engine.packverify import ShardCheck
from casckpt.errors import (
    BlobNotFoundError,
    CorruptPackError,
    InvalidArgumentError,
    MissingDataError,
    OversizedObjectError,
    StorageError,
    StorageFullError,
    UnsafeObjectError,
)
from casckpt.format.chunks import object_id
from casckpt.format.keys import pack_key, shard_key
from casckpt.format.shard import (
    SHARD_HEADER_SIZE,
    ShardHeader,
    encode_shard_header,
    payload_checksum,
)
from casckpt.storage.base import scatter
from casckpt.storage.erasure import DEFAULT_ALGORITHM, ErasureCode, Redundancy
from casckpt.storage.locations import CurrentLocations, Location, LocationSet, refused

log = logging.getLogger(__name__)

_LAYOUT_CACHE = 4096
_RECOVERED_KEPT = 2  # rebuilt packs kept for the other ranges of one restore (~64 MiB each)


class PackStore:
    """Stores, reads, verifies and repairs packs. Thread-safe.

    ``io`` runs shard writes and reads in parallel; it must not be a pool
    whose tasks call into this object (the engine's read pool may).
    """

    def __init__(self, catalog: Catalog, locations: CurrentLocations, io: ThreadPoolExecutor,
                 quorum: int | None = None) -> None:
        self.catalog = catalog
        self._current = locations
        self._io = io
        self._quorum = quorum
        self._codes: dict[tuple[int, int, str], ErasureCode] = {}
        self._layouts: OrderedDict[str, PackLayout] = OrderedDict()
        self._recovered: OrderedDict[str, bytes] = OrderedDict()
        self._pack_locks: dict[str, Lock] = {}
        self._lock = Lock()

    @property
    def locations(self) -> LocationSet:
        """The store's locations now."""
        return self._current.get()

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
            failures: list[StorageError] = []
            for loc in targets:
                try:
                    loc.blobs.put_file(key, path)
                    return PackLayout(pack_id, key, size, shards=(ShardRow(0, loc.id, key, size),))
                except StorageError as exc:
                    log.warning("pack %s: location %s refused it: %s", pack_id, loc.describe(), exc)
                    failures.append(exc)
            raise refused(f"pack {pack_id}", failures)
        self.check_writable(redundancy)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise StorageError(f"cannot read the staging pack {path}: {exc}") from exc
        path.unlink(missing_ok=True)
        layout, payloads = self._encode(pack_id, data, redundancy)
        del data  # shards hold every byte now; bound the memory of the packs in flight
        failures = []
        written = self._place(layout, payloads, self.locations.placement(pack_id), failures)
        healthy = self._durable(written)
        if healthy < self.quorum(redundancy):
            self.locations.delete([(sh.location_id, sh.key) for sh in written if sh.state == "ok"])
            message = (f"pack {pack_id} is durable on only {healthy} of {redundancy.shards} shards "
                       f"(shards sharing a failure domain count once); the write quorum is "
                       f"{self.quorum(redundancy)}")
            if failures and all(isinstance(f, StorageFullError) for f in failures):
                raise refused(f"shards of pack {pack_id}", failures)
            raise StorageError(f"{message}. Check the locations (`casckpt location list`)")
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
                ) -> tuple[PackLayout, dict[int, ShardPayload]]:
        """The objects a pack is stored as, by shard index (only ``only``, if given)."""
        key = pack_key(pack_id)
        wanted = set(range(redundancy.shards) if only is None else only)
        if redundancy.kind != "ec":  # a copy is checked against the pack id itself
            layout = PackLayout(pack_id, key, len(data), redundancy.kind, 1, redundancy.m)
            return layout, {i: ShardPayload(data, None) for i in sorted(wanted)}
        code = self._code(redundancy.k, redundancy.m, algorithm)
        fragments, stripe, offset = code.encode(data)
        payloads: dict[int, ShardPayload] = {}
        for index, fragment in enumerate(fragments):
            fragments[index] = b""  # bound peak memory: each fragment is held once
            if index in wanted:
                checksum = payload_checksum(fragment)
                header = ShardHeader(pack_id, index, code.k, code.m, code.algorithm, len(data),
                                     len(fragment), offset, checksum)
                payloads[index] = ShardPayload(encode_shard_header(header) + fragment, checksum)
            del fragment
        layout = PackLayout(pack_id, key, len(data), "ec", code.k, code.m, code.algorithm, stripe, offset)
        return layout, payloads

    def _object_key(self, layout: PackLayout, index: int) -> str:
        return layout.key if layout.scheme != "ec" else shard_key(layout.id, index)

    def _place(self, layout: PackLayout, payloads: dict[int, ShardPayload],
               order: Sequence[Location], failures: list[StorageError] | None = None) -> list[ShardRow]:
        """Write payload ``i`` to ``order[i]`` (distinct failure domains), using spares on refusal.

        With fewer domains than payloads, erasure-coded shards double up (in
        placement order); copies of a pack share one key, so they never do.
        Returns one row per payload: ``ok`` where written, else ``missing``;
        each refusal is appended to ``failures``.
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
                if failures is not None:
                    failures.append(exc)
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

    def read_into(self, pack_id: str, offset: int, buffers: Sequence[memoryview], *,
                  heal: bool = True) -> int:
        """Fill ``buffers`` with pack bytes from ``offset``; returns the bytes read.

        Reads copies or data shards by range; falls back to rebuilding the
        pack (:meth:`recover`, healing unless ``heal=False``) when a shard it
        needs is gone. The caller verifies what it reads and calls
        :meth:`recover` on a mismatch.

        Raises:
            BlobNotFoundError: the pack is not in the catalog (GC removed it).
            MissingDataError, CorruptPackError: too few healthy shards.
        """
        layout = self._must_layout(pack_id)
        if layout.scheme == "ec":
            return self._read_striped(layout, offset, buffers, heal)
        last: StorageError | None = None
        for sh, loc in self._readable(layout):
            try:
                return loc.blobs.read_into(sh.key, offset, buffers)
            except StorageError as exc:
                self._damaged(layout, {sh.index: _state_of(exc)}, f"{loc.describe()}: {exc}")
                last = exc
        if layout.scheme == "none":
            raise BlobNotFoundError(
                f"pack {pack_id} cannot be read from {self._where(layout)} ({last}); restore another "
                "version, or add redundancy (`casckpt redundancy`) to survive this") from last
        return scatter(memoryview(self.recover(pack_id, heal=heal))[offset:], buffers)

    def _read_striped(self, layout: PackLayout, offset: int, buffers: Sequence[memoryview],
                      heal: bool = True) -> int:
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
                return self._from_recovered(layout, offset, buffers, heal)
            pieces.append((sh, loc, base + pos - index * stripe, part))
            pos += take
        for sh, loc, at, part in pieces:
            try:
                got = loc.blobs.read_into(sh.key, at, part)
            except StorageError as exc:
                self._damaged(layout, {sh.index: _state_of(exc)}, f"{loc.describe()}: {exc}")
                return self._from_recovered(layout, offset, buffers, heal)
            if got < sum(len(p) for p in part):
                self._damaged(layout, {sh.index: "corrupt"}, "shard is truncated")
                return self._from_recovered(layout, offset, buffers, heal)
        return want

    def _from_recovered(self, layout: PackLayout, offset: int, buffers: Sequence[memoryview],
                        heal: bool) -> int:
        return scatter(memoryview(self.recover(layout.id, heal=heal))[offset:], buffers)

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
            data, last = b"", None
            for sh, loc in self._readable(layout):
                try:
                    data = loc.blobs.get(sh.key, max_size=layout.size)  # a copy is the whole pack
                    break
                except StorageError as exc:
                    self._damaged(layout, {sh.index: _state_of(exc)}, f"{loc.describe()}: {exc}")
                    last = exc
        if data and object_id(data) == pack_id:
            return data
        if layout.scheme == "none":
            why = "damaged (its bytes do not hash to its id)" if data else f"unreadable ({last})"
            raise (CorruptPackError if data else MissingDataError)(
                f"pack {pack_id} on {self._where(layout)} is {why}; it has no redundancy to rebuild "
                "it from. Run `casckpt check` to list the versions affected")
        return self.recover(pack_id)

    def _where(self, layout: PackLayout) -> str:
        names = [loc.describe() for sh in layout.shards
                 if (loc := self.locations.get(sh.location_id)) is not None]
        return ", ".join(names) or "an unknown location"

    # -- verify, heal, repair ---------------------------------------------------

    def examine(self, pack_id: str, *, read_all: bool = True) -> ShardCheck:
        """Read shards in full, verify each, rebuild the pack (see :func:`.packverify.examine`)."""
        return packverify.examine(self, pack_id, read_all=read_all)

    def read_detached(self, layout: PackLayout) -> tuple[bytes | None, dict[int, str]]:
        """Read a pack the catalog does not know yet (see :func:`.packverify.read_detached`)."""
        return packverify.read_detached(self, layout)

    def recover(self, pack_id: str, *, heal: bool = True) -> bytes:
        """Rebuild a pack from its healthy shards and heal the damaged ones (heal on read;
        ``heal=False`` leaves them to ``repair``, as ``check`` must).

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
                data = self._recover(pack_id, heal)
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

    def _recover(self, pack_id: str, heal: bool) -> bytes:
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
        if damaged and heal:
            try:
                packrepair.rewrite(self, self._fresh_layout(pack_id), found.data, damaged, found.fragments)
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

    def repair(self, pack_id: str) -> RepairOutcome:
        """Rebuild this pack's shards that are not ``ok`` or sit on a location not active, and
        spread shards that share a failure domain once another is free (see :mod:`.packrepair`)."""
        return packrepair.repair(self, pack_id)

    def delete(self, shards: Sequence[tuple[int, str]]) -> int:
        """Delete shard objects ((location id, key)); returns how many went (see
        :meth:`LocationSet.delete`)."""
        return len(self.locations.delete(shards))


def _state_of(exc: StorageError) -> str:
    """A shard that could not be read: ``corrupt`` when something else sits at its key (not a
    regular file, or larger than recorded), else ``missing``."""
    return "corrupt" if isinstance(exc, (OversizedObjectError, UnsafeObjectError)) else "missing"


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


"""Reading packs: ranged reads of copies, striped reads of data shards, reconstruction.

Reads go to healthy data shards (or copies), local locations first, by
range. When a read finds a data shard missing or damaged, or a copy
damaged, the pack is reconstructed from any K healthy shards, verified
against its id, and the damaged shards found on the way are healed
(written again); those that cannot be are left marked for ``repair``. A
copy found missing is simply skipped for the next one and queued for
``repair``; a parity shard is only read (and its damage found) when it is
needed or by a scrub (``check --read-data``).

A shard whose location cannot be reached (a dropped connection, a timeout,
throttling, access denied) is not damaged, only unreachable: nothing is
marked. When too few shards can be reached, the read waits with backoff for
up to the storage retry budget (``CASCKPT_STORAGE_RETRY_S``), logging that it
is waiting, then raises :class:`~casckpt.errors.StoreUnavailableError`.
"""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from threading import Lock

from casckpt.catalog import Catalog, PackLayout, ShardRow
from casckpt.catalog import shards as sql
from casckpt.catalog.tiers import pack_states
from casckpt.engine.packlayer.packlayouts import Layouts, shard_state_of
from casckpt.engine.packlayer.packrepair import PackRepairer
from casckpt.engine.packlayer.packverify import PackVerifier, ShardCheck
from casckpt.engine.versions.durability import not_durable_error
from casckpt.errors import (
    BlobNotFoundError,
    CorruptPackError,
    MissingDataError,
    StorageError,
    StoreUnavailableError,
)
from casckpt.format.chunks import object_id
from casckpt.format.shard import SHARD_HEADER_SIZE
from casckpt.storage.base import scatter
from casckpt.storage.locations import CurrentLocations, Location, LocationSet

log = logging.getLogger(__name__)

_RECONSTRUCTED_KEPT = 2  # reconstructed packs kept for the other ranges of one restore (~64 MiB each)
_FIRST_WAIT_S = 0.5  # backoff ceilings while storage is unreachable: 0.5, 1, 2, 4, 5, 5, ... s
_MAX_WAIT_S = 5.0


class PackReader:
    """Reads packs by range or whole, reconstructing them from surviving shards when it must.

    Thread-safe. Each call reads with one snapshot of the locations. ``retry_s`` is the
    storage retry budget: how long a read waits for unreachable locations to come back.
    """

    def __init__(self, catalog: Catalog, locations: CurrentLocations, layouts: Layouts,
                 verifier: PackVerifier, repairer: PackRepairer, retry_s: float = 30.0) -> None:
        self._retry_s = retry_s
        self._catalog = catalog
        self._locations = locations
        self._layouts = layouts
        self._verifier = verifier
        self._repairer = repairer
        self._reconstructed: OrderedDict[str, bytes] = OrderedDict()
        self._pack_locks: dict[str, Lock] = {}
        self._waits: dict[str, float] = {}  # pack id -> when its read began waiting for storage
        self._lock = Lock()

    @property
    def retry_s(self) -> float:
        """The storage retry budget, in seconds."""
        return self._retry_s

    def waiting_s(self) -> float | None:
        """How long the longest read now waiting for storage has waited (None: none waits)."""
        with self._lock:
            began = min(self._waits.values(), default=None)
        return None if began is None else time.monotonic() - began

    def read_into(self, pack_id: str, offset: int, buffers: Sequence[memoryview], *,
                  heal: bool = True) -> int:
        """Fill ``buffers`` with pack bytes from ``offset``; returns the bytes read.

        Reads copies or data shards by range; falls back to reconstructing the
        pack (:meth:`reconstruct`, healing unless ``heal=False``) when a shard it
        needs is gone. The caller verifies what it reads and calls
        :meth:`reconstruct` on a mismatch.

        Raises:
            BlobNotFoundError: the pack is not in the catalog (GC removed it), or it has
                no redundancy and its one copy is gone.
            MissingDataError, CorruptPackError: too few healthy shards.
            StoreUnavailableError: too few shards could be reached within the retry budget.
            VersionNotDurableError, VersionLostError: the pack is on a fast tier (another
                host's, or lost with one) and not on the locations.
        """
        self._require_located(pack_id)
        layout = self._layouts.require(pack_id)
        locations = self._locations.get()
        if layout.scheme == "ec":
            return self._read_striped(layout, locations, offset, buffers, heal)
        last: StorageError | None = None
        unreachable = False
        for sh, loc in _readable(layout, locations):
            try:
                return loc.blobs.read_into(sh.key, offset, buffers)
            except StorageError as exc:
                unreachable |= not self._record(layout, sh, loc, exc)
                last = exc
        if layout.scheme == "none" and not unreachable:
            if last is not None and shard_state_of(last) == "corrupt":
                raise _damaged(layout, locations, last) from last
            raise BlobNotFoundError(
                f"pack {pack_id} cannot be read from {_where(layout, locations)} ({last}); restore "
                "another version, or add redundancy (`casckpt redundancy`) to survive this") from last
        return self._from_reconstructed(layout, offset, buffers, heal)

    def _read_striped(self, layout: PackLayout, locations: LocationSet, offset: int,
                      buffers: Sequence[memoryview], heal: bool = True) -> int:
        stripe, base = layout.stripe or 0, SHARD_HEADER_SIZE + (layout.data_offset or 0)
        want = min(sum(len(b) for b in buffers), max(0, layout.size - offset))
        pieces: list[tuple[ShardRow, Location, int, list[memoryview]]] = []
        rest, pos = list(buffers), offset
        while pos < offset + want:
            index = pos // stripe
            take = min(stripe * (index + 1), offset + want) - pos
            part, rest = _split(rest, take)
            sh = layout.shard(index)
            loc = locations.get(sh.location_id) if sh is not None else None
            if sh is None or loc is None or not loc.readable or sh.state != "ok":
                return self._from_reconstructed(layout, offset, buffers, heal)
            pieces.append((sh, loc, base + pos - index * stripe, part))
            pos += take
        for sh, loc, at, part in pieces:
            try:
                got = loc.blobs.read_into(sh.key, at, part)
            except StorageError as exc:
                self._record(layout, sh, loc, exc)
                return self._from_reconstructed(layout, offset, buffers, heal)
            if got < sum(len(p) for p in part):
                self._layouts.mark_damaged(layout, {sh.index: "corrupt"}, "shard is truncated")
                return self._from_reconstructed(layout, offset, buffers, heal)
        return want

    def _record(self, layout: PackLayout, sh: ShardRow, loc: Location, exc: StorageError) -> bool:
        """Note a failed read of a shard or copy: queue it for repair when the failure proves
        it missing or damaged (True); a location that could not be reached proves nothing
        and marks nothing (False)."""
        state = shard_state_of(exc)
        if state is None:
            log.info("pack %s: shard %d unreachable on %s: %s", layout.id, sh.index, loc.describe(), exc)
            return False
        self._layouts.mark_damaged(layout, {sh.index: state}, f"{loc.describe()}: {exc}")
        return True

    def _from_reconstructed(self, layout: PackLayout, offset: int, buffers: Sequence[memoryview],
                            heal: bool) -> int:
        return scatter(memoryview(self.reconstruct(layout.id, heal=heal))[offset:], buffers)

    def _require_located(self, pack_id: str) -> None:
        """Raise unless the pack is (as far as the catalog says now) on the locations."""
        layout = self._layouts.get(pack_id)
        if layout is None or layout.tier is None:
            return
        layout = self._layouts.get(pack_id, fresh=True)  # drained since it was cached?
        if layout is None or layout.tier is None:
            return
        state = pack_states(self._catalog, [pack_id]).get(pack_id, ("fast", layout.tier))
        raise not_durable_error(self._catalog, pack_id, layout.tier, state[0])

    def can_reconstruct(self, pack_id: str) -> bool:
        """Whether the pack has redundancy to reconstruct a damaged copy or shard from."""
        layout = self._layouts.get(pack_id)
        return layout is not None and layout.scheme != "none"

    def get(self, pack_id: str) -> bytes:
        """The whole pack, verified against its id (reconstructed from shards if it must be).

        Raises:
            BlobNotFoundError: the pack is not in the catalog.
            MissingDataError, CorruptPackError: it cannot be read back intact.
            StoreUnavailableError: too few shards could be reached within the retry budget.
            VersionNotDurableError, VersionLostError: as :meth:`read_into`.
        """
        self._require_located(pack_id)
        layout = self._layouts.require(pack_id)
        locations = self._locations.get()
        unreachable = False
        if layout.scheme == "ec":
            buf = bytearray(layout.size)
            self._read_striped(layout, locations, 0, [memoryview(buf)])
            data = bytes(buf)
        else:
            data, last = b"", None
            for sh, loc in _readable(layout, locations):
                try:
                    data = loc.blobs.get(sh.key, max_size=layout.size)  # a copy is the whole pack
                    break
                except StorageError as exc:
                    unreachable |= not self._record(layout, sh, loc, exc)
                    last = exc
        if data and object_id(data) == pack_id:
            return data
        if layout.scheme == "none" and not unreachable:
            if not data and last is not None and shard_state_of(last) == "corrupt":
                raise _damaged(layout, locations, last) from last
            why = "damaged (its bytes do not hash to its id)" if data else f"unreadable ({last})"
            raise (CorruptPackError if data else MissingDataError)(
                f"pack {pack_id} on {_where(layout, locations)} is {why}; it has no redundancy to "
                "reconstruct it from. Run `casckpt check` to list the versions affected")
        return self.reconstruct(pack_id)

    def reconstruct(self, pack_id: str, *, heal: bool = True) -> bytes:
        """Reconstruct a pack from its healthy shards and heal the damaged ones (heal on read;
        ``heal=False`` leaves them to ``repair``, as ``check`` must).

        Single-flight per pack: restore reads a pack in several ranges at
        once, and all of them wait for one reconstruction. The last few
        reconstructed packs are kept (packs are immutable, so they never go stale).
        A heal that fails is logged and leaves the shards marked for ``repair``. A read-only
        catalog (store opened read-only) heals nothing and marks nothing.

        Raises:
            BlobNotFoundError: the pack is not in the catalog.
            MissingDataError: too few healthy shards; names the pack and what is wrong
                (its chunks are marked lost, so commits write them again).
            StoreUnavailableError: enough shards might be healthy, but too few could be
                reached within the retry budget; nothing is marked.
        """
        with self._lock:
            pack_lock = self._pack_locks.setdefault(pack_id, Lock())
        with pack_lock:
            with self._lock:
                cached = self._reconstructed.get(pack_id)
            if cached is not None:
                return cached
            try:
                data = self._reconstruct(pack_id, heal)
            except BaseException:
                with self._lock:
                    self._pack_locks.pop(pack_id, None)
                raise
            with self._lock:
                self._reconstructed[pack_id] = data
                while len(self._reconstructed) > _RECONSTRUCTED_KEPT:
                    old, _ = self._reconstructed.popitem(last=False)
                    self._pack_locks.pop(old, None)
            return data

    def _reconstruct(self, pack_id: str, heal: bool) -> bytes:
        layout = self._layouts.require(pack_id, fresh=True)
        started = time.monotonic()
        try:
            found = self._examine_waiting(layout, started)
        finally:
            with self._lock:
                self._waits.pop(layout.id, None)
        if found.data is None:
            sql.mark_pack_lost(self._catalog, pack_id)
            needed = layout.k if layout.scheme == "ec" else 1
            details = "; ".join(f"shard {i}: {n}" for i, n in sorted(found.notes.items()))
            raise MissingDataError(
                f"pack {pack_id} cannot be reconstructed: {len(found.healthy)} healthy shard(s) of "
                f"{len(layout.shards)}, {needed} needed ({details}). Restore another version; "
                "`casckpt check` lists every version affected")
        damaged = [sh.index for sh in self._layouts.require(pack_id, fresh=True).shards if sh.state != "ok"]
        if damaged and heal and not self._catalog.read_only:  # a reader never writes shards
            try:
                self._repairer.heal(self._layouts.require(pack_id, fresh=True), found.data, damaged,
                                    found.fragments)
            except StorageError as exc:  # left marked; `casckpt repair` retries
                log.warning("pack %s: healing shards %s failed: %s", pack_id, damaged, exc)
        return found.data

    def _examine_waiting(self, layout: PackLayout, started: float) -> ShardCheck:
        """Examine the pack's shards; while it cannot be reconstructed only because too few
        shards could be reached, wait with backoff (full jitter) and examine again, until the
        retry budget from ``started`` runs out (the wait is listed in ``_waits``).

        Raises:
            StoreUnavailableError: the budget ran out with too few shards reachable.
        """
        needed = layout.k if layout.scheme == "ec" else 1
        waits = 0
        while True:
            found = self._verifier.examine(layout.id, read_all=False)
            if found.data is None:
                found = self._verifier.examine(layout.id, read_all=True)
            if found.data is not None or not found.unreachable \
                    or len(found.healthy) + len(found.unreachable) < needed:
                return found
            waited = time.monotonic() - started
            details = "; ".join(f"shard {i}: {found.notes[i]}" for i in sorted(found.unreachable))
            if waited >= self._retry_s:
                raise StoreUnavailableError(
                    f"pack {layout.id} cannot be read now: {len(found.healthy)} shard(s) of "
                    f"{len(layout.shards)} reachable, {needed} needed, after waiting {waited:.0f} s "
                    f"for storage ({details}). Nothing was found missing and nothing was marked "
                    "for repair; try again once the storage is back (CASCKPT_STORAGE_RETRY_S sets "
                    "how long reads wait)")
            waits += 1
            pause = min(self._retry_s - waited,
                        random.uniform(0, min(_MAX_WAIT_S, _FIRST_WAIT_S * 2.0 ** (waits - 1))))
            log.warning("pack %s: waiting for storage: %d of %d shard(s) unreachable, %d needed; "
                        "retrying for up to %.0f s more (%s)", layout.id, len(found.unreachable),
                        len(layout.shards), needed, self._retry_s - waited, details)
            with self._lock:
                self._waits.setdefault(layout.id, started)
            time.sleep(pause)


def _readable(layout: PackLayout, locations: LocationSet) -> list[tuple[ShardRow, Location]]:
    """Shards worth reading, best first: healthy, data shards, local locations."""
    out = [(sh, loc) for sh in layout.shards if (loc := locations.get(sh.location_id)) is not None
           and loc.readable and (sh.state == "ok" or layout.scheme == "none")]
    return sorted(out, key=lambda pair: (pair[0].index >= layout.k, pair[1].remote, pair[0].index))


def _where(layout: PackLayout, locations: LocationSet) -> str:
    names = [loc.describe() for sh in layout.shards if (loc := locations.get(sh.location_id)) is not None]
    return ", ".join(names) or "an unknown location"


def _damaged(layout: PackLayout, locations: LocationSet, exc: StorageError) -> CorruptPackError:
    """A pack without redundancy whose one copy is there but refused (altered, swapped)."""
    return CorruptPackError(
        f"pack {layout.id} on {_where(layout, locations)} is damaged ({exc}); it has no redundancy "
        "to reconstruct it from. Restore another version; `casckpt check` lists every version "
        "affected, and redundancy (`casckpt redundancy`) survives this")


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

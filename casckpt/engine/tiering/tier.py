"""A fast tier in front of the store's locations: commits land on local disk, a drain moves
them to the locations in the background, and every version says how durable it is.

The write path (one-process commits: ``Store.commit``, blocking or in the background):
the packer fills each pack in the tier's ``staging/`` when the tier's disk has room for it
(:meth:`FastTier.room_for`) and hands the finished pack to :meth:`FastTier.write`, which
renames it into the tier directory (fsync'd, :class:`~casckpt.storage.fasttier.FastTierDir`)
and records it as a ``fast`` pack of this tier (no shards). A pack the tier's disk has no
room for, whatever the budget says, is filled in the store's own staging directory and
stored on the locations as if there were no tier: a full tier slows commits down to the
locations' speed, it never fails them. The manifest is kept on the tier, and the
version is published ``durability="fast"`` with the ``fast`` packs it needs
(:func:`casckpt.catalog.publish.insert_deps`: only packs held on a tier count, so a version
whose packs all went to the locations waits only for the drain to store its manifest). The
commit returns; nothing remote was written but the tag records.

The drain (:func:`drain`, run by a :class:`DrainWorker` thread of every writable store with
a tier, by ``casckpt drain``, and once more by ``Store.close``) takes the tier's ``fast``
packs oldest first. Each is read from the tier into memory, checked against its id (nothing
is written on the tier: a full tier drains all the same), and stored on the locations with
the redundancy recorded on its row, exactly as a commit without a tier would store it, under
a catalog lease (gc deletes no object a drain is writing), and then made ``live`` with its
shards in one transaction. A version none of whose packs is ``fast`` any more gets its
manifest written to every location and becomes ``durable``. A process killed anywhere in
this leaves either a ``fast`` pack (drained again from the start: the objects are
content-addressed, so the second upload writes the same keys) or a ``live`` one; never a row
naming shards that are not there. One process drains a tier at a time (the tier's
``drain.lock``).

Reads (:class:`~casckpt.engine.packlayer.packs.Packs`) take a pack from the tier when it holds it,
verified like any read; a damaged copy of a drained pack is evicted and the pack read from
the locations. The tier is a cache with a budget (``fast_tier_bytes``): after each drain,
drained packs are evicted least recently used first, except those of the newest
``keep_fast_last`` versions, until what is held fits the budget and the tier's disk has room
for the next pack (:data:`ROOM_PACKS` packs): the disk's real free space counts, a budget
larger than the disk included. A pack not drained yet is never evicted. When the packs not
yet drained fill the budget, a commit's next pack waits for the drain (``backpressure=
"block"``) or raises :class:`~casckpt.errors.CommitBackpressureError` (``"raise"``).

Loss: a tier directory found without its identity where this host had a tier at that path
(wiped, a new disk) is a new tier, and the old one is declared lost at open
(:func:`casckpt.catalog.tiers.declare_lost`): its packs and their chunks become ``lost``,
every version needing one becomes ``lost`` -- reported by ``log``, ``show`` and ``check``,
skipped by ``@latest``, refused by restore (:class:`~casckpt.errors.VersionLostError`). A
pack missing from its own tier when the drain comes for it is lost the same way.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from casckpt.catalog import Catalog, PackLayout
from casckpt.catalog import gc as gc_sql
from casckpt.catalog import tiers as sql
from casckpt.catalog.leases import begin_lease, release_lease
from casckpt.catalog.tiers import FastPack
from casckpt.config import DEFAULT_PACK_SIZE
from casckpt.engine.versions.nodes import StoreNodes
from casckpt.engine.versions.references import references
from casckpt.errors import (
    BlobNotFoundError,
    CasckptError,
    CommitBackpressureError,
    CorruptPackError,
    DrainTimeoutError,
    StorageError,
    VersionLostError,
)
from casckpt.format import objectnames
from casckpt.storage.erasure import Redundancy
from casckpt.storage.fasttier import FastTierDir
from casckpt.storage.scratch import ScratchDir, reclaim
from casckpt.types import DrainReport, ProgressCallback

log = logging.getLogger(__name__)

DRAIN_IN_FLIGHT = 2  # packs a drain uploads at once
# a pack is filled on the tier only while its disk has room for this many packs: the one being
# filled can pass pack_size by a chunk, and another process of the host may be filling one too
ROOM_PACKS = 2
ORPHAN_AGE_S = 3600.0  # a held pack the catalog does not know is evicted only once this old
_WAIT_POLL_S = (0.02, 0.5)  # wait_durable and backpressure poll from the first to the second


@dataclass(slots=True)
class _Tally:
    """What a :func:`drain` has done so far (it returns it as a :class:`DrainReport`)."""

    packs: int = 0
    bytes: int = 0
    versions: int = 0
    lost_packs: list[str] = field(default_factory=list)
    lost_versions: list[str] = field(default_factory=list)
    evicted: int = 0
    error: str | None = None

    def report(self, seconds: float, busy: bool = False) -> DrainReport:
        return DrainReport(self.packs, self.bytes, self.versions, tuple(self.lost_packs),
                           tuple(self.lost_versions), self.evicted, seconds, busy, self.error)


class FastTier:
    """This process's fast tier of one store: the directory, its id, its budget. Thread-safe."""

    def __init__(self, catalog: Catalog, directory: FastTierDir, budget: int, keep_last: int,
                 pack_size: int = DEFAULT_PACK_SIZE) -> None:
        self.catalog = catalog
        self.dir = directory
        self.id = directory.tier_id
        self.budget = budget
        self.keep_last = keep_last
        self.room = ROOM_PACKS * pack_size  # free bytes a commit wants on the disk to fill a pack here
        self.scratch = ScratchDir(directory.staging)  # packs being filled to be held here
        # tells the drain worker there is work (a commit published); the DrainWorker sets it
        self.wake: Callable[[], None] = lambda: None
        self._keep: dict[str, frozenset[str]] = {}  # version id -> packs it references (memo)
        self._lost_warned = False
        self._full_warned = False

    def __repr__(self) -> str:
        return f"FastTier({self.id}, {str(self.dir.root)!r})"

    # -- writes ---------------------------------------------------------------

    def _active(self) -> bool:
        """Whether this tier takes packs (False: it was declared lost; warned once)."""
        if sql.tier_state(self.catalog, self.id) == "active":
            return True
        if not self._lost_warned:
            log.warning("fast tier %s was declared lost (by another process that found it "
                        "wiped, or by hand); this process's packs go straight to the locations",
                        self.dir.root)
            self._lost_warned = True
        return False

    def room_for(self, size: int) -> bool:
        """Whether a pack of about ``size`` bytes is to be filled here: the tier is active and
        its disk has room for it (drained packs evicted to make some if need be), whatever
        the budget says. False: the commit fills it elsewhere and stores it on the locations."""
        if not self._active():
            return False
        want = max(self.room, ROOM_PACKS * size)
        disk = self.dir.disk()
        if disk is None or disk.free >= want:
            return True
        self.evict(free=want)
        disk = self.dir.disk()
        if disk is None or disk.free >= want:
            return True
        if not self._full_warned:
            log.warning("fast tier %s: its disk has %s free, too few for the next pack (the "
                        "budget, %s, is not the limit: the disk is); packs go straight to the "
                        "locations until the drain frees room", self.dir.root, _mib(disk.free),
                        _mib(self.budget))
            self._full_warned = True
        return False

    def write(self, pack_id: str, path: Path, size: int, redundancy: Redundancy,
              backpressure: str) -> PackLayout | None:
        """Hold the finished pack ``path``, filled in :attr:`scratch` (the tier's own disk:
        a rename), on the tier (consuming it); its layout, recorded by the caller, makes it a
        ``fast`` pack. None: the tier could not take it (declared lost, or its disk failed:
        logged), so the caller stores the pack on the locations.

        Raises:
            CommitBackpressureError: the packs not yet drained fill the budget and
                ``backpressure`` is ``"raise"``.
        """
        if not self._active():  # declared lost since room_for said yes
            return None
        self._make_room(size, backpressure)
        try:
            self.dir.put_pack(pack_id, path)
        except StorageError as exc:
            log.warning("fast tier %s could not take pack %s (%s); it goes straight to the "
                        "locations", self.dir.root, pack_id, exc)
            return None
        return PackLayout(pack_id, objectnames.pack_name(pack_id), size, redundancy.kind, redundancy.k,
                          redundancy.m, tier=self.id)

    def _make_room(self, size: int, backpressure: str) -> None:
        """Wait (or raise) while the packs not drained, with this one, would exceed the budget;
        evict drained packs when everything held would."""
        delay = _WAIT_POLL_S[0]
        warned = False
        while True:
            _, pending = sql.undrained_bytes(self.catalog, self.id)
            if pending == 0 or pending + size <= self.budget:
                break
            if backpressure == "raise":
                raise CommitBackpressureError(
                    f"the fast tier {self.dir.root} holds {pending} bytes not drained yet, and "
                    f"this pack ({size} bytes) would pass its budget of {self.budget} bytes "
                    "(fast_tier_bytes); wait for the drain (store.tier.wait_durable()), give the tier a "
                    "larger budget, or open the store with backpressure='block'")
            if not warned:
                log.warning("fast tier %s: %d bytes wait for the drain, the budget is %d; the "
                            "commit waits for room (backpressure='block')", self.dir.root, pending,
                            self.budget)
                warned = True
            self.wake()
            time.sleep(delay)
            delay = min(delay * 2, _WAIT_POLL_S[1])
        self.evict(extra=size)

    # -- eviction -------------------------------------------------------------

    def evict(self, extra: int = 0, free: int | None = None) -> int:
        """Evict drained packs, least recently used first, until what is held (and ``extra``
        about to be) fits the budget and the tier's disk has ``free`` bytes free (default:
        :attr:`room`, what a commit wants to fill a pack here); never a pack not drained, nor
        one of the newest ``keep_last`` versions' packs. Returns the bytes freed."""
        held = self.dir.resident()
        over = sum(r.size for r in held) + extra - self.budget
        disk = self.dir.disk()
        short = 0 if disk is None else (self.room if free is None else free) - disk.free
        if over <= 0 and short <= 0:
            return 0
        states = sql.pack_states(self.catalog, (r.pack_id for r in held))
        keep: frozenset[str] | None = None
        freed, now = 0, time.time()
        for r in held:
            if freed >= over and freed >= short:
                break
            state = states.get(r.pack_id)
            if state is None and now - r.used_at < ORPHAN_AGE_S:
                continue  # a commit may be recording it right now
            if state is not None and state[0] != "live":
                continue  # not drained: the only copy
            if keep is None:
                keep = self._kept()
            if r.pack_id in keep:
                continue
            freed += self.dir.evict(r.pack_id)
        return freed

    def disk_problems(self) -> list[str]:
        """What makes this tier's budget untrue: a budget larger than its disk, or a disk
        with too little free space for the next pack (``tier status``, ``check``)."""
        disk = self.dir.disk()
        if disk is None:
            return []
        found = []
        if self.budget > disk.total:
            found.append(f"the budget ({_mib(self.budget)}, fast_tier_bytes) exceeds the file "
                         f"system holding the tier ({_mib(disk.total)}): the disk, not the budget, "
                         "limits what the tier holds; give it a budget below the disk's size")
        if disk.free < self.room:
            found.append(f"the tier's file system has {_mib(disk.free)} free, less than the "
                         f"{_mib(self.room)} a commit wants to fill a pack there: commits store "
                         "their packs on the locations (slower) until drained packs are evicted "
                         "or space is freed")
        return found

    def _kept(self) -> frozenset[str]:
        """The packs the newest ``keep_last`` versions reference (kept resident)."""
        if self.keep_last <= 0:
            return frozenset()
        newest = sql.newest_versions(self.catalog, self.keep_last)
        todo = [v for v in newest if v not in self._keep]
        if todo:
            nodes = StoreNodes(self.catalog)
            for batch in gc_sql.manifest_batches(self.catalog, todo):
                for row in batch:
                    try:
                        ids = {c.hex() for c in references(row, nodes, set())}
                    except CasckptError as exc:
                        log.warning("fast tier: cannot list the packs of %s to keep them (%s)",
                                    row.id[:12], exc)
                        ids = set()
                    found = self.catalog.find_chunks(ids, live_only=False)
                    self._keep[row.id] = frozenset(loc.pack_id for loc in found.values())
        for old in [v for v in self._keep if v not in newest]:
            del self._keep[old]
        return frozenset().union(*(self._keep.get(v, frozenset()) for v in newest))

    def close(self) -> None:
        """Release the scratch directory and the tier directory."""
        self.scratch.close()
        self.dir.close()


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def open_tier(catalog: Catalog, base: Path | str, budget: int, keep_last: int, *,
              read_only: bool = False, pack_size: int = DEFAULT_PACK_SIZE) -> FastTier | None:
    """This host's fast tier of the store at ``base`` (its directory made if need be), recorded
    in the catalog; a tier this host had at the same path and lost (the directory wiped) is
    declared lost, with a warning naming the versions lost with it, and what dead commits
    left in its ``staging/`` is reclaimed. A read-only store uses a tier only if it exists
    (None otherwise) and records nothing. ``pack_size``: the store's (see
    :meth:`FastTier.room_for`)."""
    root = Path(base).expanduser() / catalog.store_id
    if read_only and not (root / "casckpt-tier").is_file():
        return None
    directory = FastTierDir(base, catalog.store_id)
    tier = FastTier(catalog, directory, budget, keep_last, pack_size)
    catalog.fast_tier = tier.id
    if read_only:
        return tier
    reclaim(directory.staging)  # packs dead commits were filling here
    host = socket.gethostname()
    known = {t.id: t for t in sql.tiers(catalog)}
    if tier.id not in known:
        sql.register(catalog, tier.id, host, str(directory.root))
    if directory.created:
        for old in known.values():
            if old.host == host and old.path == str(directory.root) and old.state == "active":
                declare_lost(catalog, old.id, f"its directory {old.path} was found without its "
                             "identity record (wiped or replaced)")
    return tier


def declare_lost(catalog: Catalog, tier_id: str, why: str) -> sql.Lost:
    """Declare a tier lost, warning with ``why`` and the versions lost with it (at open, or
    by hand: ``store.tier.forget``)."""
    lost = sql.declare_lost(catalog, tier_id)
    if lost.versions:
        log.warning("fast tier %s is lost (%s) before %d pack(s) drained: %d version(s) are lost "
                    "with it and cannot be restored: %s. Every version committed durably is "
                    "unaffected; `casckpt log` marks the lost ones", tier_id, why, len(lost.packs),
                    len(lost.versions), ", ".join(v[:12] for v in lost.versions[:10]))
    elif lost.packs:
        log.warning("fast tier %s is lost (%s): %d pack(s) no version needed were lost with it",
                    tier_id, why, len(lost.packs))
    return lost


# -- the drain -------------------------------------------------------------------


def drain(tier: FastTier, store_pack: Callable[[str, bytes, Redundancy], PackLayout],
          put_manifest: Callable[[str, bytes], object], *, wait: bool = False,
          progress: ProgressCallback | None = None,
          stop: threading.Event | None = None) -> DrainReport:
    """Drain the tier once: every ``fast`` pack to the locations (``store_pack``, the pack
    layer's write of a pack's bytes), then the manifests of the versions this makes durable
    (``put_manifest``), then evict what the budget and the tier's disk say. ``wait``: wait
    for another process's drain of this tier to finish rather than return at once with
    ``busy``. Stops early when ``stop`` is set.

    Errors storing a pack stop the drain (``report.error``; the pack stays ``fast``, drained
    again next time); a pack missing from the tier is lost (``report.lost_*``)."""
    report = _Tally()
    started = time.monotonic()
    with tier.dir.drain_lock(wait=wait) as held:
        if not held:
            return report.report(0.0, busy=True)
        try:
            _drain_packs(tier, store_pack, report, progress, stop)
            _finish_versions(tier, put_manifest, report)
        except CasckptError as exc:
            report.error = str(exc)
            log.warning("the drain of fast tier %s stopped: %s (it resumes on the next drain)",
                        tier.dir.root, exc)
        seconds = time.monotonic() - started
        if report.packs:
            tier.dir.note_drain(report.bytes, seconds)
        try:
            report.evicted = tier.evict()
        except CasckptError as exc:
            log.warning("fast tier %s: eviction failed: %s", tier.dir.root, exc)
    return report.report(seconds)


def _drain_packs(tier: FastTier, store_pack: Callable[[str, bytes, Redundancy], PackLayout],
                 report: _Tally, progress: ProgressCallback | None,
                 stop: threading.Event | None) -> None:
    """Store the tier's fast packs on the locations, :data:`DRAIN_IN_FLIGHT` at a time (one
    upload's request latency hides behind another's bytes, as a commit's packs do), oldest
    first; the first error stops the drain once the uploads in flight are done."""
    todo = deque(sql.fast_packs(tier.catalog, tier.id))
    total = sum(p.size for p in todo)
    failure: BaseException | None = None
    with ThreadPoolExecutor(DRAIN_IN_FLIGHT, thread_name_prefix="casckpt-drain") as pool:
        running: deque[tuple[FastPack, Future[bool | None]]] = deque()
        while todo or running:
            while todo and len(running) < DRAIN_IN_FLIGHT and failure is None and not (
                    stop is not None and stop.is_set()):
                pack = todo.popleft()
                running.append((pack, pool.submit(_drain_one, tier, store_pack, pack)))
            if not running:
                break  # stopped (what was found lost so far is still recorded below)
            pack, future = running.popleft()
            try:
                drained = future.result()
            except BaseException as exc:  # noqa: BLE001 - re-raised once the others are done
                failure = failure or exc
                continue
            if drained is None:
                report.lost_packs.append(pack.id)
            elif drained:
                report.packs += 1
                report.bytes += pack.size
            if progress is not None:
                progress("drain", report.bytes, total)
    _record_lost(tier, report)
    if failure is not None:
        raise failure


def _drain_one(tier: FastTier, store_pack: Callable[[str, bytes, Redundancy], PackLayout],
               pack: FastPack) -> bool | None:
    """Drain one pack under its own lease (gc deletes none of the objects being written):
    True when this drain made it live, False when it no longer waited (drained by another, or
    its tier declared lost meanwhile), None when it is gone from the tier or damaged there
    (the only copy: lost, never stored under its id)."""
    lease = begin_lease(tier.catalog)
    try:
        try:
            data = tier.dir.read_verified(pack.id, pack.size)
        except BlobNotFoundError:
            return None
        except CorruptPackError as exc:  # the only copy is damaged: lost, never stored as is
            log.warning("%s", exc)
            with suppress(StorageError):
                tier.dir.evict(pack.id)
            return None
        layout = store_pack(pack.id, data, Redundancy(pack.scheme, pack.k, pack.m))
        return sql.mark_drained(tier.catalog, layout)
    finally:
        release_lease(tier.catalog, lease, f"the drain of pack {pack.id}")


def _record_lost(tier: FastTier, report: _Tally) -> None:
    if report.lost_packs:
        lost = sql.lose_packs(tier.catalog, report.lost_packs, tier.id)
        report.lost_versions += list(lost.versions)
        log.warning("fast tier %s: %d pack(s) waiting to drain are gone from %s; %d version(s) "
                    "needing them are lost: %s", tier.id, len(report.lost_packs), tier.dir.root,
                    len(lost.versions), ", ".join(v[:12] for v in lost.versions[:10]))


def _finish_versions(tier: FastTier, put_manifest: Callable[[str, bytes], object],
                     report: _Tally) -> None:
    """Versions none of whose packs waits any more: manifest to the locations, then durable."""
    while True:
        ready = sql.finishable(tier.catalog)
        if not ready:
            return
        for version_id in ready:
            data = tier.dir.manifest(version_id) or tier.catalog.manifest(version_id)
            put_manifest(objectnames.manifest_name(version_id), data)
        done = sql.finish(tier.catalog, ready)
        report.versions += len(done)
        for version_id in done:
            tier.dir.drop_manifest(version_id)
        if len(ready) < 1000:
            return


class DrainWorker:
    """A daemon thread draining the tier whenever a commit publishes (and every ``interval``
    seconds), backing off while the drain fails."""

    def __init__(self, tier: FastTier, run_drain: Callable[[threading.Event], DrainReport],
                 interval: float = 2.0) -> None:
        self._tier = tier
        self._run = run_drain
        self._interval = interval
        self._event = threading.Event()
        self._stop = threading.Event()
        self.last: DrainReport | None = None
        self._thread = threading.Thread(target=self._loop, name="casckpt-drain", daemon=True)
        tier.wake = self._event.set
        self._event.set()  # at once: what a process killed mid-drain left is resumed on open
        self._thread.start()

    def _loop(self) -> None:
        delay = self._interval
        while not self._stop.is_set():
            self._event.wait(delay)
            self._event.clear()
            if self._stop.is_set():
                return
            try:
                self.last = self._run(self._stop)
                failed = self.last.error is not None
            except Exception as exc:  # noqa: BLE001 - a daemon must outlive any one failure
                log.warning("the drain of fast tier %s failed: %s", self._tier.dir.root, exc)
                failed = True
            delay = min(delay * 2, 30.0) if failed else self._interval

    def stop(self) -> None:
        """Stop the thread (a drain in progress finishes its current pack first)."""
        self._stop.set()
        self._event.set()
        self._thread.join()


def wait_durable(catalog: Catalog, version_ids: list[str], timeout: float | None,
                 wake: Callable[[], None]) -> None:
    """Wait until every version among ``version_ids`` is durable.

    Raises:
        VersionLostError: one was lost before it drained.
        DrainTimeoutError: ``timeout`` seconds passed first.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = _WAIT_POLL_S[0]
    todo = list(version_ids)
    while todo:
        states = sql.durability(catalog, todo)
        lost = [v for v in todo if states.get(v) == "lost"]
        if lost:
            raise VersionLostError(
                f"version(s) {', '.join(v[:12] for v in lost)} were lost before they drained: their "
                "fast tier was lost. Restore an earlier version (`casckpt log` marks the lost ones)")
        todo = [v for v in todo if states.get(v) == "fast"]
        if not todo:
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise DrainTimeoutError(
                f"{len(todo)} version(s) are not durable yet after {timeout} s (the first: "
                f"{todo[0][:12]}); the drain goes on in the background (`casckpt tier status` "
                "shows it; `casckpt drain --wait` on the committing host finishes it)")
        wake()
        time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(delay * 2, _WAIT_POLL_S[1])

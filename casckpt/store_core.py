"""What a :class:`casckpt.store.Store` and its namespaces share: one open store's state and lifecycle.

``Store`` and each namespace (``store.locations``, ``keys``, ``tier``, ``retention``, ``ops``)
take this object in their constructor; none of them reaches into another. Lifecycle: built
once by :func:`casckpt.opening.open_store`, which hands it to the ``Store``; usable until
:meth:`StoreCore.close`, which finishes background commits and releases every resource.

The engine (:class:`~casckpt.engine.context.EngineContext`: pack layer, thread pools,
caches; and the :class:`~casckpt.engine.write.background.BackgroundCommitter`) is built on
first use, not at open: a store opened to query its catalog builds none of it. Everything
open checks (the catalog's schema, the locations' identity) is checked before this object
exists; building the engine checks nothing and opens nothing remote.

Thread-safety: the engine is built once, under a lock, by whichever thread needs it first
(the caller's, a background commit's or the drain worker's); ``current_locations`` is
replaced (never mutated in place) when locations change, so readers see the old set or the
new one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from casckpt import config as cfg
from casckpt.cache import IndexCache
from casckpt.catalog import Catalog
from casckpt.catalog import shards as shard_sql
from casckpt.catalog.rows import VersionRow
from casckpt.catalog.rows import version as version_of
from casckpt.engine.locations.leftovers import reclaim_leftovers
from casckpt.engine.locations.probe import LocationProber
from casckpt.engine.versions.durability import check_readable
from casckpt.engine.versions.refs import load_manifest, resolve
from casckpt.errors import (
    CasckptError,
    InvalidArgumentError,
    ReadOnlyStoreError,
    StoreIdentityError,
    refuse_forked,
)
from casckpt.format.crypto import PLAIN, StoreCrypto
from casckpt.storage import BlobStore, open_blob_store, redact_url
from casckpt.storage.locations import CurrentLocations, Location, LocationSet
from casckpt.storage.registry import BackendOptions
from casckpt.storage.scratch import ScratchDir
from casckpt.storage.sealed import sealed
from casckpt.storage.unreachable import UnreachableBlobStore
from casckpt.types import DrainReport, ProgressCallback, Version

if TYPE_CHECKING:
    from casckpt.catalog import PackLayout
    from casckpt.dcp import StoreWriter
    from casckpt.engine.context import EngineContext
    from casckpt.engine.tiering.tier import DrainWorker, FastTier
    from casckpt.engine.write.background import BackgroundCommitter
    from casckpt.format.manifest import Manifest
    from casckpt.storage.erasure import Redundancy

Ref = str | Version
log = logging.getLogger(__name__)

LOCATION_REFRESH_S = 30.0  # how stale this process's view of location states may get


def utc(ts: float) -> datetime:
    """A catalog timestamp (epoch seconds) as an aware UTC datetime."""
    return datetime.fromtimestamp(ts, tz=timezone.utc)


def open_location_store(name: str, url: str, backends: BackendOptions, given: dict[str, BlobStore], *,
                        create: bool = True, failed: bool = False, crypto: StoreCrypto = PLAIN) -> BlobStore:
    """Open one location's blob store; one this host cannot open is kept as unreachable.

    ``create=False`` for a location the catalog knows already: its directory, gone, is
    then unreachable rather than made again, empty (see :class:`~casckpt.storage.LocalBlobStore`).
    A location marked failed that cannot be opened is what was expected: no warning.
    An encrypted store's (``crypto``) is sealed (:mod:`casckpt.storage.sealed`).
    """
    blob_store = given.get(url)
    if blob_store is None:
        try:
            blob_store = open_blob_store(url, backends, create=create)
        except (CasckptError, OSError) as exc:
            if not failed:
                log.warning("blob location %s (%s) cannot be opened: %s", name, redact_url(url),
                            redact_url(str(exc)))
            blob_store = UnreachableBlobStore(url, str(exc))
    return sealed(blob_store, crypto)


@dataclass(frozen=True, slots=True)
class _Engine:
    """What :meth:`StoreCore.ctx` builds on first use, and :meth:`StoreCore.close` releases."""

    ctx: EngineContext
    committer: BackgroundCommitter
    io: ThreadPoolExecutor  # the pack layer's shard reads and writes

    def release(self) -> None:
        """Stop the pools and the erasure-coding workers (the committer is closed already)."""
        self.ctx.pool.shutdown(wait=True)
        self.ctx.uploads.shutdown(wait=True)
        self.ctx.packs.close()
        self.io.shutdown(wait=True)


class StoreCore:
    """One open store's shared state: the catalog, the locations, the engine, close.

    Fields (set by the constructor; the parts read them, only this class reassigns them):

    - ``catalog``, ``cache``, ``config`` (the store's settings), ``current_locations``
      (see :attr:`locations`): what open built; a catalog query needs nothing else.
    - ``ctx``: the :class:`~casckpt.engine.context.EngineContext` every engine call takes,
      built on first use (see :attr:`ctx`).
    - ``committer``: the :class:`~casckpt.engine.write.background.BackgroundCommitter` that
      orders every commit of this store (foreground and background), built with ``ctx``.
    - ``root``: the store's root directory (None: named by its catalog and locations only).
    - ``prober``: measures location health for ``store.locations.list``.
    - ``dcp_writers``: DCP saves writing through this store (close waits for none, but
      refuses while one is busy, and ends the leases of failed ones).
    - ``backends``: the backend options (by URL scheme) locations are opened with.
    - ``config_file``: the store's ``casckpt.toml`` (None: opened without one).
    - ``recovering``: opened with ``recover=True`` over data the empty catalog lacks;
      cleared by a catalog rebuild.
    - ``read_only``: why the store was opened read-only (None: writable); see
      :meth:`refuse_write`.
    - ``closed``: :meth:`close` has run.
    """

    def __init__(self, *, root: Path | None, catalog: Catalog, cache: IndexCache, locations: LocationSet,
                 staging: Path, settings: cfg.Settings, write_quorum: int | None = None,
                 backends: BackendOptions | None = None, config_file: Path | None = None,
                 recovering: bool = False, read_only: str | None = None,
                 tier: FastTier | None = None, background_drain: bool = True) -> None:
        self.root = root
        self.recovering = recovering
        self.read_only = read_only
        self._locations_loaded = time.monotonic()
        self.backends: BackendOptions = dict(backends or {})
        self.config_file = config_file
        if read_only is None:  # a reader leaves dead commits' files to the writers
            reclaim_leftovers(staging, locations)  # staging and tmp files of dead commits
        self._staging = ScratchDir(staging)
        self._pid = os.getpid()  # the process the connections, pools and cache belong to
        self._catalog = catalog
        self._cache = cache
        self.config = settings
        self.current_locations = CurrentLocations(locations)
        self._write_quorum = write_quorum
        self._engine: _Engine | None = None
        self._engine_lock = threading.Lock()
        self._released = False  # set under the lock: no engine is built after close released it
        self.prober = LocationProber()
        self.closed = False
        self.dcp_writers: weakref.WeakSet[StoreWriter] = weakref.WeakSet()
        self.tier = tier
        self.drainer: DrainWorker | None = None
        if tier is not None and read_only is None and not recovering and background_drain:
            from casckpt.engine.tiering.tier import DrainWorker

            self.drainer = DrainWorker(tier, lambda stop: self.drain(stop=stop))

    @property
    def catalog(self) -> Catalog:
        """The store's catalog (see :meth:`refuse_forked` for the one error)."""
        self.refuse_forked()
        return self._catalog

    @property
    def cache(self) -> IndexCache:
        """This host's index cache (see :meth:`refuse_forked` for the one error)."""
        self.refuse_forked()
        return self._cache

    def refuse_forked(self) -> None:
        """Every use of the store in a forked child stops here (its catalog, cache, engine and
        committer), before it touches what the parent owns; objects the engine handed out
        (commit handles, DCP readers and writers) check the same (:func:`casckpt.errors.refuse_forked`).

        Raises:
            ForkedStoreError: this process is a fork of the one that opened the store.
        """
        refuse_forked(self._pid)

    @property
    def locations(self) -> LocationSet:
        """The store's locations now (a snapshot; a later swap does not change it)."""
        return self.current_locations.get()

    @property
    def crypto(self) -> StoreCrypto:
        """The store's encryption (keyed chunk ids; :data:`~casckpt.format.crypto.PLAIN` when the
        store is not encrypted): the catalog's, set once when the store is opened."""
        return self.catalog.crypto

    # -- the engine, built on first use ----------------------------------------

    @property
    def ctx(self) -> EngineContext:
        """The engine context, built by the first caller that needs it (thread-safe, once).

        Raises:
            InvalidArgumentError: the store is closed.
        """
        return self._built().ctx

    @property
    def committer(self) -> BackgroundCommitter:
        """The committer, built with :attr:`ctx` (see there)."""
        return self._built().committer

    @property
    def started_committer(self) -> BackgroundCommitter | None:
        """The committer if the engine is built (None: nothing was committed, restored or read
        through this handle yet, so no commit is pending)."""
        self.refuse_forked()
        engine = self._engine
        return engine.committer if engine is not None else None

    def _built(self) -> _Engine:
        self.refuse_forked()
        engine = self._engine
        if engine is not None and not self._released:
            return engine
        with self._engine_lock:
            if self._released:  # built or not: its pools are shut down or will never be
                raise InvalidArgumentError("this store is closed: open it again (casckpt.open) "
                                           "to commit, restore or read its data")
            if self._engine is None:
                self._engine = self._build()
            return self._engine

    def _build(self) -> _Engine:
        """The pack layer, pools, caches and committer (imported here: a catalog query loads none)."""
        from casckpt.engine.context import EngineContext
        from casckpt.engine.memory.deltabase import BaseCache
        from casckpt.engine.memory.staging import StagingBuffers
        from casckpt.engine.packlayer.packs import Packs
        from casckpt.engine.write.background import BackgroundCommitter

        settings = self.config
        io = ThreadPoolExecutor(max(4, len(self.locations.all)), thread_name_prefix="casckpt-shard")
        ctx = EngineContext(
            catalog=self.catalog, cache=self.cache, current_locations=self.current_locations,
            packs=Packs.open(self.catalog, self.current_locations, io, quorum=self._write_quorum,
                             encode_workers=settings.upload_workers, retry_s=settings.storage_retry_s,
                             tier=self.tier),
            staging=self._staging, config=settings, device_buffers=StagingBuffers(settings.staging_memory),
            bases=BaseCache(settings.delta_memory),
            pool=ThreadPoolExecutor(settings.workers, thread_name_prefix="casckpt"),
            uploads=ThreadPoolExecutor(settings.upload_workers, thread_name_prefix="casckpt-upload"),
        )
        committer = BackgroundCommitter(ctx, max_pending=settings.max_pending_commits,
                                        memory=settings.commit_memory, backpressure=settings.backpressure)
        return _Engine(ctx, committer, io)

    def nudge_drain(self) -> None:
        """Get the drain going: wake the drain worker, or without one (``background_drain=False``,
        the CLI) drain once in this thread, unless another process of the host is draining."""
        if self.drainer is not None and self.tier is not None:
            self.tier.wake()
        elif self.tier is not None and self.read_only is None:
            self.drain()

    def drain(self, *, wait: bool = False, progress: ProgressCallback | None = None,
              stop: threading.Event | None = None) -> DrainReport:
        """Drain the fast tier once (see :func:`casckpt.engine.tiering.tier.drain`)."""
        from casckpt.engine.tiering.tier import drain

        if self.tier is None:
            return DrainReport()
        def write(pack_id: str, data: bytes, redundancy: Redundancy) -> PackLayout:
            return self.ctx.packs.writer.write_bytes(pack_id, data, redundancy)  # built on the first pack

        return drain(self.tier, write, self.locations.put_everywhere, wait=wait, progress=progress, stop=stop)

    # -- lifecycle ----------------------------------------------------------

    def close(self) -> None:
        """Finish pending background commits, then release threads, the cache, pooled
        connections and clients. Idempotent (see ``Store.close`` for what it raises)."""
        if self.closed:
            return
        if os.getpid() != self._pid:  # a forked child: everything here is the parent's to release
            self.closed = True
            return
        self._refuse_close_while_saving()
        self.closed = True
        try:
            committer = self.started_committer  # one another thread builds meanwhile: see _release
            if committer is not None:
                committer.close()
        finally:
            try:
                self._last_drain()
            finally:
                self._release()

    def _last_drain(self) -> None:
        """Stop the drain worker and drain what is left (a failure is logged: the next open on
        this host, or `casckpt drain`, resumes it). A drain another process of this host runs
        now is waited out, not trusted to finish this handle's work: it may have listed the
        tier's packs before this handle's last commit."""
        if self.drainer is None:
            return
        self.drainer.stop()
        try:
            report = self.drain(wait=True)
        except CasckptError as exc:
            log.warning("closing the store: the drain of the fast tier failed (%s); `casckpt drain` "
                        "or the next open on this host resumes it", exc)
            return
        if report.error is not None:
            log.warning("closing the store: the fast tier %s could not drain everything (%s); "
                        "`casckpt drain` or the next open on this host resumes it",
                        self.tier.dir.root if self.tier else "?", report.error)

    def _refuse_close_while_saving(self) -> None:
        """A DCP save (``dcp.async_save``) still writing through this store must finish first."""
        if any(writer.busy for writer in list(self.dcp_writers)):
            raise InvalidArgumentError(
                "a dcp.save / dcp.async_save is writing through this store: wait for it (the "
                "future async_save returned) before closing the store"
            )

    def _release(self) -> None:
        with self._engine_lock:  # from here on no thread builds an engine
            self._released = True
            engine = self._engine
        for writer in list(self.dcp_writers):  # DCP tells a writer nothing when a save fails
            writer.release()  # so end the GC leases of failed saves here
        try:
            if engine is not None:
                engine.committer.close()  # idempotent: for an engine another thread built meanwhile
        finally:
            if engine is not None:
                engine.release()
            self.cache.close()
            self.catalog.close()
            self.locations.close()
            self._staging.close()
            if self.tier is not None:
                self.tier.close()

    def refuse_while_recovering(self, what: str) -> None:
        """A store opened with ``recover=True`` over data its empty catalog lacks does nothing
        but rebuild the catalog until it has.

        Raises:
            StoreIdentityError: the store is recovering; names the rebuild to run.
        """
        if self.recovering:
            raise StoreIdentityError(
                f"cannot {what}: this store was opened with recover=True and its catalog is empty "
                "while its locations hold data; run store.ops.rebuild_catalog() (`casckpt catalog "
                "rebuild`) first")

    def refuse_write(self, what: str, needs: str = "the catalog and the locations") -> None:
        """Called first by every operation that writes, before it touches anything.

        Raises:
            ReadOnlyStoreError: the store is read-only; names ``what`` and what it ``needs``.
        """
        if self.read_only is not None:
            raise ReadOnlyStoreError(
                f"{what} needs write access to {needs}; this store was opened read-only because "
                f"{self.read_only}. Open it writable (without read_only=True / --read-only / "
                "CASCKPT_READ_ONLY=1, with credentials that may write) to do this",
                right=needs)

    # -- locations ----------------------------------------------------------

    def refresh_locations(self) -> None:
        """Pick up location changes other processes made (add, retire, fail) every so often."""
        if time.monotonic() - self._locations_loaded >= LOCATION_REFRESH_S:
            self.reload_locations({})

    def reload_locations(self, opened: dict[str, BlobStore]) -> None:
        """Re-read locations from the catalog, keeping the blob stores already open."""
        current = {loc.id: loc.blobs for loc in self.locations.all}
        fresh = []
        for row in shard_sql.locations(self.catalog):
            if row.id in current:
                fresh.append(Location(row.id, row.name, row.domain, row.state, current[row.id]))
            else:
                blobs = open_location_store(row.name, row.url or "", self.backends, opened, create=False,
                                            failed=row.state == "failed", crypto=self.crypto)
                fresh.append(Location(row.id, row.name, row.domain, row.state, blobs))
        self.current_locations.swap(LocationSet(fresh))  # running operations keep the set they took
        self._locations_loaded = time.monotonic()

    # -- refs and versions --------------------------------------------------

    def row(self, ref: Ref) -> VersionRow:
        """The catalog row of the version ``ref`` names.

        Raises:
            RefNotFoundError, AmbiguousRefError: bad ref.
        """
        return resolve(self.catalog, ref.id if isinstance(ref, Version) else ref)

    def readable_row(self, ref: Ref) -> VersionRow:
        """:meth:`row`, for a version about to be read: refused before any byte is read when
        it cannot be read whole from this host.

        Raises:
            VersionLostError: it was lost with its fast tier before it drained.
            VersionNotDurableError: it waits on another host's fast tier.
        """
        row = self.row(ref)
        if row.durability != "durable":
            check_readable(self.catalog, row.id, row.durability)
        return row

    def manifest(self, ref: Ref) -> Manifest:
        """The whole manifest of the version ``ref`` names, to read its data (see
        :meth:`readable_row` for errors)."""
        return load_manifest(self.catalog, self.readable_row(ref))

    def version(self, row: VersionRow, tags: tuple[str, ...] | None = None) -> Version:
        """A catalog row as a :class:`Version` (its tags read unless given)."""
        if tags is None:
            tags = self.catalog.tags_of([row.id]).get(row.id, ())
        return version_of(row, tags)

"""The Store facade: the training and query surface of one open store, and its namespaces.

:class:`Store` answers what a training loop and a person looking at checkpoints ask. It is
declared in four classes, each method in exactly one: ``Store`` itself (open and close, copies
into other stores, run handles and gc); its base classes
:class:`~casckpt.store_write.StoreWrite` (commits, background commits, directory snapshots,
imports, the DCP writer) and :class:`~casckpt.store_read.StoreRead` (restores, tensor loads,
checkouts, exports, the DCP reader); and their base
:class:`~casckpt.store_history.StoreHistory` (log, show, diff, history, tags, forks, lineage,
delete and undelete). Everything else lives in a namespace named by its concept, one module
each (``locations``, ``keys``, ``tier``, ``retention``, ``ops``, ``mirrors``: see
:class:`Store`'s attributes). All of them share one :class:`~casckpt.store_core.StoreCore`
(engine context, pools, committer, close), the one place the components are built. A ``Store``
is thread-safe: concurrent commits and restores from several threads share its pools (the
catalog serialises what must be serial).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from datetime import timedelta
from types import TracebackType
from typing import Any

from casckpt.engine.versions.validate import check_name
from casckpt.errors import CasckptError, CopyTargetError, InvalidArgumentError
from casckpt.run import Run, save_rule, set_policy
from casckpt.storage import redact_url
from casckpt.store_core import Ref, StoreCore
from casckpt.store_keys import Keys
from casckpt.store_locations import Locations
from casckpt.store_mirrors import Mirrors, Opener
from casckpt.store_ops import Ops
from casckpt.store_read import StoreRead
from casckpt.store_retention import Retention
from casckpt.store_tier import Tier
from casckpt.store_write import StoreWrite
from casckpt.types import CopyReport, GCReport, ProgressCallback, RetentionPolicy, Version

log = logging.getLogger(__name__)


class Store(StoreWrite, StoreRead):
    """A casckpt store: commit, restore and query checkpoint versions.

    Build one with :func:`casckpt.open`. Use it as a context manager, or call
    :meth:`close` when done.

    Attributes:
        path: the store's root directory (None: named by its catalog and locations only).
        locations: blob locations and redundancy (:class:`~casckpt.store_locations.Locations`).
        keys: master keys of an encrypted store (:class:`~casckpt.store_keys.Keys`).
        tier: the fast tier (:class:`~casckpt.store_tier.Tier`).
        retention: retention policies (:class:`~casckpt.store_retention.Retention`).
        ops: check, repair, drills, report, audit, stats, rebuilds (:class:`~casckpt.store_ops.Ops`).
        mirrors: mirrors into other stores (:class:`~casckpt.store_mirrors.Mirrors`).
    """

    locations: Locations
    keys: Keys
    tier: Tier
    retention: Retention
    ops: Ops
    mirrors: Mirrors

    def __init__(self, core: StoreCore, *, created: bool = False, opener: Opener | None = None) -> None:
        self.path = core.root
        self._created = created
        super().__init__(core)
        self.locations = Locations(self._core)
        self.keys = Keys(self._core)
        self.tier = Tier(self._core)
        self.retention = Retention(self._core)
        self.ops = Ops(self._core, self)
        self.mirrors = Mirrors(self._core, self, opener)
        self._opener = opener

    # -- lifecycle ----------------------------------------------------------

    def close(self) -> None:
        """Stop the mirror threads (``store.mirrors.start``), finish pending background
        commits, drain the fast tier (when the store has one:
        a drain that fails is logged and resumes at the next open), then release threads,
        the cache, pooled connections and clients. Idempotent.

        Raises:
            BackgroundCommitError: a background commit failed and nobody waited on its
                handle (everything is released all the same).
            InvalidArgumentError: a ``dcp.async_save`` is still writing through the store
                (nothing is closed; wait for its future, then close).
        """
        try:
            self.mirrors.stop_all()
        finally:
            self._core.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            self.close()
            return
        try:  # an error is on its way out already: report a background failure, do not mask it
            self.close()
        except CasckptError as failure:
            log.error("while closing the store after %s: %s", exc_type.__name__ if exc_type else "?", failure)

    @property
    def created(self) -> bool:
        """Whether :func:`casckpt.open` created this store (a path that held none, or a catalog
        that knew no location); it then logs one WARNING naming where. Pass ``create=False``
        where a store must already exist, so a mistyped path fails instead of starting over."""
        return self._created

    @property
    def read_only(self) -> str | None:
        """Why this store is read-only (``read_only=True`` given, or what this process cannot
        write), or None: writable. A read-only store's write calls raise ReadOnlyStoreError."""
        return self._core.read_only

    def __repr__(self) -> str:
        return f"<casckpt.Store {redact_url(self._core.locations.all[0].blobs.url)}>"

    # -- copies, runs and gc ------------------------------------------------

    def copy(self, refs: Ref | Iterable[Ref], to: Store | str | os.PathLike[str], *, dry_run: bool = False,
             progress: ProgressCallback | None = None, lineage: bool = True,
             to_key_file: str | os.PathLike[str] | None = None) -> CopyReport:
        """Copy versions into store ``to``, as git pushes commits: each arrives as the same
        version (its id, run, step, metadata, metrics, message and the source's tags on it),
        with its ancestors up to the nearest one ``to`` holds, so its lineage is whole. Only
        the chunks ``to`` lacks are read and sent, verified on arrival and packed by ``to``'s
        own writer (its pack size, compression, redundancy and locations); each version is
        published last, in one catalog transaction, as commits are. Idempotent: a copy again
        sends nothing (``report.nothing_sent``). Resumable: a copy killed midway leaves no
        version half-visible, and the next copy does not send again the packs it stored.
        Leases on both stores keep either's gc from deleting what the copy needs. Between
        stores whose chunk ids are keyed differently (one encrypted and one not, or two data
        keys) each version is committed again under the destination's keys: every byte is
        read, only what the destination lacks is written, and the version gets another id
        there (``report.ids`` maps them). How it works: docs/ARCHITECTURE.md, Copying between
        stores; docs/guides/copy.md.

        Args:
            refs: one ref or several, as :meth:`resolve` takes them, or a run's name for every
                visible version of the run.
            to: the destination, another open store (writable unless ``dry_run``), or its
                directory: opened for the copy (created where there is none, but by a dry run,
                which plans against an empty store and writes nothing), its key from
                ``to_key_file`` alone (never ``CASCKPT_KEY_FILE``, this store's key).
            to_key_file: the master key file of an encrypted destination named by its path.
            dry_run: plan only: the report says what would be sent; nothing is written.
            progress: called with ``("copy", bytes sent, bytes to send)``.
            lineage: also copy each version's ancestors up to the nearest one ``to`` holds
                (the default). False: the versions named alone (a mirror's way); each then
                names a parent ``to`` may not show, as a version whose ancestors were deleted.

        Raises:
            CopyTargetError: ``to`` is this store (or not a Store).
            CopyUnsupportedError: across keys, a version was saved by many ranks.
            CopyConflictError: ``to`` has another version at a copied version's run and step.
            ReadOnlyStoreError: ``to`` is read-only.
            RefNotFoundError, AmbiguousRefError: a bad ref.
            MissingDataError, CorruptChunkError: the source cannot read a chunk whole.
        """
        from casckpt.store_copy import copy_versions, opened_destination

        named = [refs] if isinstance(refs, (str, Version)) else list(refs)
        if isinstance(to, (str, os.PathLike)) and self._opener is not None:
            key = None if to_key_file is None else os.fspath(to_key_file)
            with opened_destination(self._opener, os.fspath(to), key, dry_run) as dest:
                return self.copy(named, dest, dry_run=dry_run, progress=progress, lineage=lineage)
        if not isinstance(to, Store):
            raise CopyTargetError(f"copy(to=) takes an open casckpt.Store or a store's directory, "
                                  f"got {type(to).__name__}")
        return copy_versions(self._core, to._core, named, dry_run=dry_run, progress=progress, lineage=lineage)

    def run(self, name: str, *, retention: RetentionPolicy | Mapping[str, Any] | None = None,
            redundancy: str | None = None, delta_chain: int | None = None,
            save_every: int | timedelta | tuple[int, timedelta] | None = None) -> Run:
        """A handle on run ``name``: ``save``, ``restore``, ``should_save`` and the rest without
        repeating ``run=`` (see :class:`casckpt.run.Run`). The policies given are stored for
        the run now (as ``store.retention.set``, ``store.locations.set_redundancy``,
        ``store.ops.set_delta_chain``: creating the run); ``save_every`` (steps, a timedelta,
        or both) is what ``should_save`` asks.

        Raises:
            InvalidNameError: bad run name.
            InvalidArgumentError: a bad ``save_every`` or policy, naming it.
        """
        check_name(name, "run")
        handle = Run(self, name, save_rule(save_every))
        if retention is not None:
            set_policy(self, name, retention)
        if redundancy is not None:
            self.locations.set_redundancy(redundancy, run=name)
        if delta_chain is not None:
            self.ops.set_delta_chain(delta_chain, run=name)
        return handle

    def gc(self, *, dry_run: bool = False, grace: float | timedelta | None = None,
           force: bool = False, progress: ProgressCallback | None = None) -> GCReport:
        """Apply every run's retention policy, then reclaim space no version needs.

        Safe while other processes commit and restore (see
        :mod:`casckpt.engine.maintenance.gc`). Only one GC runs at a time.

        Args:
            dry_run: report what would happen; delete nothing. On a read-only store
                it plans retention only (``GCReport.space_counted`` is False).
            grace: how long deleted versions stay undeletable and unreferenced
                data stays in place (seconds or timedelta; default 6 hours).
                ``0`` reclaims at once (tests, or when no reader is active).
            force: delete even when the locations hold manifests the catalog does
                not know, or many objects of unknown packs (the circuit breakers of
                :mod:`casckpt.engine.maintenance.gcguard`); never without the store's identity.

        GC deletes an object only with positive proof that it is garbage (see
        :mod:`casckpt.engine.maintenance.gcguard`); objects it could not prove are left in
        place and listed in ``GCReport.kept``.

        Raises:
            GCRunningError: another GC holds the lock.
            GCRefusedError: deleting is not proven safe; nothing was changed.
            StorageError, CatalogError: listing or the catalog failed; GC
                stopped without deleting any object it had not already
                unlinked from the catalog.
        """
        from casckpt.engine.maintenance import gc as gc_engine  # the sweep's engine: only gc needs it

        if not dry_run:
            self._core.refuse_write("gc", "the catalog and the locations (it deletes from both)")
        self._core.refuse_while_recovering("gc")
        seconds = grace.total_seconds() if isinstance(grace, timedelta) else grace
        if seconds is None:
            seconds = gc_engine.DEFAULT_GRACE_S
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
            0 <= seconds < float("inf")
        ):
            raise InvalidArgumentError(f"grace must be a finite number of seconds >= 0, got {grace!r}")
        return gc_engine.collect(self._core.ctx, grace=float(seconds), dry_run=dry_run, force=force,
                                 progress=progress)

"""The Store facade: the public API of one open store, delegating to its parts.

This is the only module that builds components; everything below it receives
what it needs. ``Store`` owns a :class:`~casckpt.store_core.StoreCore` (the state
every part shares: engine context, pools, committer, close) and the parts built on
it, each a class taking the core in its constructor:
:class:`~casckpt.store_queries.StoreQueries` (versions, runs, lineage),
:class:`~casckpt.store_retention.StoreRetention` (policies, deletes, gc),
:class:`~casckpt.store_admin.StoreAdmin` (locations, redundancy, check, repair) and
:class:`~casckpt.store_distributed.StoreDistributed` (many ranks, DCP). Commit and
restore are ``Store``'s own. Every public method is documented here.

A ``Store`` is thread-safe: concurrent commits and restores from
several threads share its pools (the catalog serialises what must be serial).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, overload

from casckpt import config as cfg
from casckpt.cache import IndexCache
from casckpt.catalog import Catalog
from casckpt.engine import treeviews
from casckpt.engine.background import CommitHandle
from casckpt.engine.refs import bind, load_manifest
from casckpt.engine.validate import check_name
from casckpt.errors import CasckptError, CheckoutMismatchError, CommitTimeoutError, InvalidArgumentError
from casckpt.format.manifest import decode_manifest
from casckpt.run import Run, save_rule, set_policy
from casckpt.storage import redact_url
from casckpt.storage.locations import LocationSet
from casckpt.store_admin import StoreAdmin
from casckpt.store_core import Ref, StoreCore
from casckpt.store_distributed import StoreDistributed
from casckpt.store_drills import Duration, StoreDrills
from casckpt.store_queries import StoreQueries
from casckpt.store_retention import StoreRetention
from casckpt.types import (
    Advice,
    AuditEntry,
    CheckReport,
    DrainReport,
    DrillReport,
    DrillResult,
    GCReport,
    GCRun,
    KeyInfo,
    LocationInfo,
    MigrationReport,
    ProgressCallback,
    RebuildReport,
    RepairReport,
    RetentionPlan,
    RetentionPolicy,
    RunInfo,
    RunNode,
    StoreStats,
    TagInfo,
    TensorHistoryEntry,
    TierLoss,
    TierStatus,
    Version,
    VersionDetail,
    VersionDiff,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

    from casckpt.dcp import StoreReader, StoreWriter
    from casckpt.engine.exporters import DirExport
    from casckpt.engine.hint import PathSpec
    from casckpt.engine.tier import FastTier

log = logging.getLogger(__name__)


class Store:
    """A casckpt store: commit, restore and query checkpoint versions.

    Build one with :func:`casckpt.open`. Use it as a context manager, or call
    :meth:`close` when done.
    """

    def __init__(self, *, root: Path | None, catalog: Catalog, cache: IndexCache,
                 locations: LocationSet, staging: Path, settings: cfg.Settings,
                 write_quorum: int | None = None, s3: Mapping[str, Any] | None = None,
                 config_file: Path | None = None, recovering: bool = False,
                 read_only: str | None = None, tier: FastTier | None = None,
                 background_drain: bool = True, created: bool = False) -> None:
        self.path = root
        self._created = created
        self._core = StoreCore(catalog=catalog, cache=cache, locations=locations, staging=staging,
                               settings=settings, write_quorum=write_quorum, s3=s3,
                               config_file=config_file, recovering=recovering, read_only=read_only,
                               tier=tier, background_drain=background_drain)
        self._queries = StoreQueries(self._core)
        self._retention = StoreRetention(self._core)
        self._admin = StoreAdmin(self._core)
        self._distributed = StoreDistributed(self._core)
        self._drills = StoreDrills(self._core)

    # -- lifecycle ----------------------------------------------------------

    def close(self) -> None:
        """Finish pending background commits, drain the fast tier (when the store has one:
        a drain that fails is logged and resumes at the next open), then release threads,
        the cache, pooled connections and clients. Idempotent.

        Raises:
            BackgroundCommitError: a background commit failed and nobody waited on its
                handle (everything is released all the same).
            InvalidArgumentError: a ``dcp.async_save`` is still writing through the store
                (nothing is closed; wait for its future, then close).
        """
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
        return f"<casckpt.Store {redact_url(self._core.ctx.locations.all[0].blobs.url)}>"

    # -- commit and restore -------------------------------------------------

    @overload
    def commit(self, state: object, *, run: str, step: int, metadata: Mapping[str, Any] | None = None,
               metrics: Mapping[str, float] | None = None, message: str | None = None,
               tags: Iterable[str] = (), progress: ProgressCallback | None = None,
               block: Literal[True] = True, group: Any = None, unchanged: PathSpec | None = None,
               trust_versions: PathSpec | bool = False, durable: bool = False) -> Version: ...

    @overload
    def commit(self, state: object, *, run: str, step: int, metadata: Mapping[str, Any] | None = None,
               metrics: Mapping[str, float] | None = None, message: str | None = None,
               tags: Iterable[str] = (), progress: ProgressCallback | None = None,
               block: Literal[False], group: None = None, unchanged: PathSpec | None = None,
               trust_versions: PathSpec | bool = False, durable: Literal[False] = False) -> CommitHandle: ...

    def commit(
        self, state: object, *, run: str, step: int, metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None, message: str | None = None,
        tags: Iterable[str] = (), progress: ProgressCallback | None = None, block: bool = True,
        group: Any = None, unchanged: PathSpec | None = None, trust_versions: PathSpec | bool = False,
        durable: bool = False,
    ) -> Version | CommitHandle:
        """Store ``state`` as version ``run@step``.

        Only chunks the store has never held are written. With ``block=True``
        (default) this returns the version once it is visible; the state is
        read, not modified, and must not be mutated until ``commit`` returns.

        With ``block=False`` it returns a :class:`CommitHandle` as soon as the
        state is snapshotted: every chunk hashed in place, and only the chunks
        the store does not hold copied (so the pause and the memory scale with
        what changed). From then on the caller may mutate its tensors; the
        rest runs in the background, in commit order. ``handle.wait()``
        returns the version or raises why it failed; a failure nobody waited
        for is raised by the next commit or by :meth:`close`. Bounds and
        backpressure: ``max_pending_commits``, ``commit_memory`` and
        ``backpressure`` of :func:`casckpt.open` (see
        :mod:`casckpt.engine.background`).

        By default every byte of the state is hashed, so the version holds exactly what the
        state held. A caller that knows what it did not mutate may say so (off by default;
        tensors are named by dotted path, e.g. ``model.blocks.0.fc.weight``):

        * ``unchanged``: paths, ``fnmatch`` globs (``"model.blocks.*"``) or a predicate
          ``path -> bool``; the caller promises each matching tensor holds, bit for bit,
          what it held in the run's previous version (this commit's parent).
        * ``trust_versions``: ``True`` or paths / globs / a predicate; the caller promises
          that every write to each matching tensor since the run's previous commit in this
          process bumped its ``tensor._version`` (in-place torch ops on the tensor, its
          views or ``.detach()``, e.g. non-fused optimizers, ``copy_``, ``load_state_dict``).
          Writes that do NOT bump it: through ``.data``, numpy arrays (``.numpy()``),
          DLPack, ``untyped_storage()``, ctypes / raw pointers, fused optimizers
          (``fused=True``), CUDA kernels of other libraries; ``.data =`` assignments,
          ``set_()`` and ``torch.utils.swap_tensors`` change the storage and are caught.
          Trusted tensors are held until the run's next commit.

        Such tensors are not read: the version reuses the parent's chunk ids for them. A
        tensor the hint names that is new to the run (or shares storage, or is packed
        with small neighbours) is hashed as usual. **A wrong hint is not detected**: the
        version then holds (and restores) the previous version's bytes for that tensor,
        and ``check(read_data=True)`` still passes, since stored bytes match their ids.

        With a fast tier (``casckpt.open(..., fast_tier=DIR)``) the commit returns once its
        packs and manifest are on the tier (fsync'd) and the version is published with
        ``durability="fast"``; the drain makes it ``"durable"`` in the background.
        ``durable=True`` returns only once it is (blocking commits; for a background one,
        ``store.wait_durable(handle.wait())``).

        Raises:
            UnsupportedStateError: the tree holds an unsupported object (nothing written).
            InvalidNameError, InvalidArgumentError: bad run/tag name, step, metadata or metrics.
            VersionExistsError: ``run`` already has a version at ``step``.
            StorageError, CatalogError: the blob store or catalog failed; the
                version is not visible and the store stays consistent.
            GroupCommitError: with ``group``, some rank failed (raised on every rank).
            ChangeHintError: a tensor declared ``unchanged`` has another dtype or shape than
                in the previous version (nothing written).
        """
        self._core.refuse_write("commit", "the catalog and the locations")
        from casckpt.engine import commit as commit_engine  # torch: only where tensors are handled
        from casckpt.engine.hint import make_hint

        req = commit_engine.make_request(run, step, metadata, metrics, message, tags)
        hint = make_hint(unchanged, trust_versions)
        self._core.refuse_while_recovering("commit")
        if group is not None:
            if hint is not None:
                raise InvalidArgumentError("group commits take no change hint (unchanged=, "
                                           "trust_versions=); commit without it")
            if not block:
                raise InvalidArgumentError(
                    "group commits block; for a background save of many ranks use "
                    "dcp.async_save(state, storage_writer=store.dcp_writer(run=..., step=...))"
                )
            def preflight() -> None:  # on every rank, inside the first collective step
                self._core.refresh_locations()
                self._core.committer.raise_unreported()  # a background failure nobody saw yet
                self._core.committer.drain()  # versions of a run appear in commit order

            return self._distributed.group_commit(state, req, group, progress, preflight)
        self._core.refresh_locations()
        if not block:
            if durable:
                raise InvalidArgumentError("durable=True needs block=True; for a background commit "
                                           "call store.wait_durable(handle.wait())")
            return self._core.committer.commit(state, req, progress, hint)
        version = self._core.committer.foreground(
            lambda: commit_engine.commit(self._core.ctx, state, req, progress, hint))
        if durable and version.durability != "durable":
            self.wait_durable(version)
            version = replace(version, durability="durable")
        return version

    def wait_durable(self, ref: Ref | None = None, timeout: float | None = None) -> None:
        """Wait until ``ref`` is durable: drained from the fast tier it was committed to, every
        pack and its manifest on the store's locations with their redundancy. ``ref`` None:
        every version of this store not durable when called (those waiting on this host's
        fast tier, when the store has one). Returns at once for durable versions, and in a
        store without a fast tier. Works from any host (it polls the catalog); the drain
        itself runs on the committing host.

        Raises:
            VersionLostError: a version was lost with its fast tier before it drained.
            DrainTimeoutError: ``timeout`` seconds passed first (the drain goes on).
            RefNotFoundError, AmbiguousRefError: bad ref.
        """
        from casckpt.catalog import tiers as tier_sql
        from casckpt.engine.tier import wait_durable

        catalog = self._core.ctx.catalog
        if ref is not None:
            ids = [self._core.row(ref).id]
        else:
            tier = self._core.tier
            ids = [v for v, state in tier_sql.not_durable(catalog, tier_id=tier.id if tier else None)
                   if state == "fast"]
        wait_durable(catalog, ids, timeout, self._core.nudge_drain)

    def drain(self, *, wait: bool = True, progress: ProgressCallback | None = None) -> DrainReport:
        """Drain this host's fast tier now, in this thread: every pack not drained to the
        locations, then the manifests of the versions that become durable, then eviction to
        the budget. ``wait``: if another process of this host is draining the tier, wait for it
        (else return at once with ``busy``). The background drain worker does the same; this
        is for scripts and ``casckpt drain``.

        Raises:
            InvalidArgumentError: the store was opened without a fast tier.
            ReadOnlyStoreError: the store is read-only.
        """
        self._core.refuse_write("drain the fast tier", "the catalog and the locations")
        if self._core.tier is None:
            raise InvalidArgumentError("this store was opened without a fast tier (fast_tier=, or "
                                       "fast_tier in casckpt.toml); there is nothing to drain")
        return self._core.drain(wait=wait, progress=progress)

    def tier_status(self) -> TierStatus:
        """Bytes per tier, versions not durable yet, this host's fast tier and its drain rate
        (see :class:`casckpt.TierStatus`)."""
        from casckpt.engine.tierstatus import tier_status

        return tier_status(self._core.ctx.catalog, self._core.tier)

    def forget_tier(self, tier_id: str) -> TierLoss:
        """Declare another host's fast tier lost by hand (its host is gone for good): the packs
        still waiting on it to drain are lost, and so is every version needing one of them
        (``log`` marks them, restore refuses them). Versions already durable are unaffected.
        ``tier_id``: the tier's id or a unique prefix of it (``casckpt tier status``). A tier
        lost already is left as it is (the report lists nothing).

        Raises:
            TierNotFoundError: no tier of this store has that id.
            AmbiguousRefError: the prefix names several tiers.
            InvalidArgumentError: it is this handle's own tier, or a tier of this host whose
                directory still holds it (drain it instead: ``casckpt drain``).
            ReadOnlyStoreError: the store is read-only.
        """
        from casckpt.engine.tierforget import forget

        self._core.refuse_write("declare a fast tier lost", "the catalog")
        return forget(self._core.ctx.catalog, self._core.tier, tier_id)

    def import_checkpoint(
        self, path: str | Path, *, run: str, step: int, metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None, message: str | None = None,
        tags: Iterable[str] = (), progress: ProgressCallback | None = None,
    ) -> Version:
        """Commit an existing checkpoint as version ``run@step``: an ordinary state version
        (tensors and plain values) that :meth:`restore`, :meth:`load_tensor` and ``dcp.load``
        read like any other.

        ``path`` is a ``.pt`` / ``.bin`` / ``.ckpt`` / ``.pth`` file (read with
        ``torch.load(weights_only=True)`` only), a ``.safetensors`` file (its header
        validated before any tensor is read), a ``torch.distributed.checkpoint`` directory,
        or a Hugging Face model directory; :mod:`casckpt.engine.importers` gives the state
        each becomes. Nothing in the file runs code.

        Raises:
            UnsafeCheckpointError: a pickle needs code execution to load (nothing committed).
            UnreadableCheckpointError: ``path`` is of no supported kind, or damaged or forged
                (nothing committed).
            UnsupportedStateError: the loaded state holds an object a version cannot hold.
            And what :meth:`commit` raises.
        """
        self._core.refuse_write("import_checkpoint", "the catalog and the locations")
        from casckpt.engine import commit as commit_engine
        from casckpt.engine.importers import read_checkpoint

        commit_engine.make_request(run, step, metadata, metrics, message, tags)  # bad names: before reading
        state = read_checkpoint(Path(path))
        return self.commit(state, run=run, step=step, metadata=metadata, metrics=metrics,
                           message=message, tags=tags, progress=progress)

    def export(self, ref: Ref, to: str | Path, *, format: str = "safetensors",
               overwrite: bool = False, progress: ProgressCallback | None = None) -> DirExport:
        """Write version ``ref`` into directory ``to`` as ``format``: ``"safetensors"``
        (``model.safetensors``; a version imported from a Hugging Face directory becomes such a
        directory again), ``"dcp"`` (a ``torch.distributed.checkpoint`` directory) or ``"pt"``
        (``checkpoint.pt``); layouts in :mod:`casckpt.engine.exporters`.

        Raises:
            InvalidArgumentError: an unknown format.
            RestoreTargetError: ``to`` cannot be written, or is a non-empty directory and
                ``overwrite`` is false (checked before any data is read).
            UnsupportedStateError: the format cannot hold the state.
            And what :meth:`restore` raises.
        """
        from casckpt.engine.exporters import check_export_dir, export_dir

        target = Path(to)
        check_export_dir(target, format, overwrite=overwrite)
        version = self.resolve(ref)
        tree = self.restore(version, map_location="cpu", progress=progress)
        return export_dir(tree, version, target, format, overwrite=overwrite)

    def pending_commits(self) -> list[CommitHandle]:
        """Background commits not finished yet, oldest first."""
        return self._core.committer.pending()

    def wait_commits(self, timeout: float | None = None) -> None:
        """Wait for every background commit; raise the first failure nobody waited on.

        Raises:
            CommitTimeoutError: ``timeout`` seconds passed with commits still running.
            BackgroundCommitError: a background commit failed unseen.
        """
        if not self._core.committer.drain(timeout):
            raise CommitTimeoutError(f"background commits still running after {timeout} s")
        self._core.committer.raise_unreported()

    @overload
    def add_dir(self, path: str | os.PathLike[str], *, run: str, step: int,
                metadata: Mapping[str, Any] | None = None, metrics: Mapping[str, float] | None = None,
                message: str | None = None, tags: Iterable[str] = (),
                progress: ProgressCallback | None = None, block: Literal[True] = True) -> Version: ...

    @overload
    def add_dir(self, path: str | os.PathLike[str], *, run: str, step: int,
                metadata: Mapping[str, Any] | None = None, metrics: Mapping[str, float] | None = None,
                message: str | None = None, tags: Iterable[str] = (),
                progress: ProgressCallback | None = None, block: Literal[False]) -> CommitHandle: ...

    def add_dir(self, path: str | os.PathLike[str], *, run: str, step: int,
                metadata: Mapping[str, Any] | None = None, metrics: Mapping[str, float] | None = None,
                message: str | None = None, tags: Iterable[str] = (),
                progress: ProgressCallback | None = None, block: bool = True) -> Version | CommitHandle:
        """Store the directory tree at ``path`` as version ``run@step``, byte-identical.

        Every directory, regular file and symbolic link is recorded: relative name, permission
        bits, size, bytes, a whole-file BLAKE3, and for a link its target text (links are never
        followed). Files are cut where their format says (safetensors tensor by tensor, zip
        archives such as ``torch.save`` output entry by entry, anything else by content-defined
        chunking), so what an earlier version holds is not written again (see
        :mod:`casckpt.format.segments`). :meth:`checkout` writes it back.

        The files are read through memory maps until the commit has read them: they must not
        change until this returns (with ``block=False``: until the handle's snapshot is taken,
        which ``add_dir`` waits for). The version's metadata records ``"casckpt.dir"``: the
        counts of files, dirs, links and their bytes. Other arguments are :meth:`commit`'s;
        ``progress`` also gets ``("scan", bytes_hashed, 0)`` while the files are read.

        Raises:
            InvalidArgumentError: ``path`` is not a directory or holds the store itself, or
                ``metadata`` uses the reserved key ``"casckpt.dir"``.
            UnsupportedFileError: the tree holds a fifo, socket or device, or a name that is
                not UTF-8 (named in the message); nothing was stored.
            Others: as :meth:`commit`.
        """
        self._core.refuse_write("add_dir", "the catalog and the locations")
        from casckpt.engine import commit as commit_engine  # torch: only where tensors are handled
        from casckpt.engine.dirscan import scan
        from casckpt.format.dirsnap import DIR_KEY

        if metadata is not None and DIR_KEY in metadata:
            raise InvalidArgumentError(f"metadata key {DIR_KEY!r} is reserved for the directory "
                                       "summary add_dir records; rename it")
        commit_engine.make_request(run, step, metadata, metrics, message, tags)  # refuse before reading
        if self.path is not None and Path(os.path.realpath(self.path)).is_relative_to(os.path.realpath(path)):
            raise InvalidArgumentError(
                f"the store {str(self.path)!r} is inside {str(path)!r}, which would change while it is "
                "read; add a directory that does not hold the store")
        state, counts = scan(path, progress, self._core.ctx.crypto.file_hasher)
        meta = {**(metadata or {}), DIR_KEY: counts}
        if block:
            return self.commit(state, run=run, step=step, metadata=meta, metrics=metrics,
                               message=message, tags=tags, progress=progress)
        return self.commit(state, run=run, step=step, metadata=meta, metrics=metrics,
                           message=message, tags=tags, progress=progress, block=False)

    def checkout(self, ref: Ref, path: str | os.PathLike[str], *,
                 progress: ProgressCallback | None = None, reuse: bool = False) -> Path:
        """Write the directory snapshot ``ref`` names (stored by :meth:`add_dir`) to ``path``.

        ``path`` must not exist or be an empty directory; with ``reuse=True`` it may also
        hold exactly this snapshot already (a restarted job's own checkpoint directory): it
        is then returned as it is, after every name, kind, permission bit and link target is
        compared and every file hashed against the BLAKE3 recorded when it was added
        (:mod:`casckpt.engine.dircompare`; nothing is written). Everything is written into a
        temporary sibling and renamed onto ``path`` at the end, every file checked against
        the BLAKE3 recorded when it was added, so ``path`` either holds the whole snapshot
        or is left as it was. Reads are streamed (at most ``BATCH_BYTES`` of
        :mod:`casckpt.engine.checkout` at a time); ``progress`` gets ``("write", bytes, total)``.
        Nothing is ever written outside ``path``: a listing naming ``..``, an absolute path or
        a path through a link is refused before anything is created.

        Returns:
            The absolute path written.

        Raises:
            RefNotFoundError, AmbiguousRefError: bad ref.
            NotADirectorySnapshotError: the version was stored with :meth:`commit` (read it
                with :meth:`restore`).
            CheckoutTargetError: ``path`` exists and is not an empty directory (untouched).
            CheckoutMismatchError: with ``reuse``, ``path`` holds something other than the
                snapshot (the first difference is named; untouched).
            CorruptChunkError, MissingDataError, FileHashMismatchError, CorruptManifestError:
                stored data is damaged, gone or forged; nothing is left at ``path``.
        """
        from casckpt.engine import checkout as checkout_engine  # torch: reads go through restore

        target = Path(path)
        if reuse and target.is_dir() and not target.is_symlink() and checkout_engine.holds_entries(target):
            from casckpt.engine.dircompare import first_difference

            manifest = self._core.manifest(ref)
            difference = first_difference(self._core.ctx, manifest, target)
            if difference is not None:
                raise CheckoutMismatchError(
                    f"{str(target)!r} does not hold {manifest.run}@{manifest.step}: {difference}; "
                    "nothing was touched. Move it away and check out again.")
            return Path(os.path.abspath(target))
        checkout_engine.check_target(Path(os.path.abspath(target)))  # before the manifest is read
        return checkout_engine.checkout(self._core.ctx, self._core.manifest(ref), target, progress)

    def restore(self, ref: Ref, into: object = None, *, map_location: Any = None,
                progress: ProgressCallback | None = None, group: Any = None,
                rank: int | None = None) -> Any:
        """Bring back the state tree of ``ref``, every byte verified.

        Args:
            ref: a ref string (``run@step``, ``run@latest``, ``run@~N``,
                ``tag:NAME``, id prefix) or a :class:`Version`.
            into: None to get a new tree; or a tree / ``nn.Module`` / optimizer /
                anything with ``state_dict``/``load_state_dict`` to restore in
                place (existing CPU tensors of matching dtype and shape are
                filled directly, without a second copy).
            map_location: device for new tensors (e.g. ``"cuda:0"``).
            group: for a version a process group committed rank by rank
                (``commit(..., group=)``): each rank of ``group`` gets its own
                state. A version saved with ``dcp.save`` restores whole here
                (every shard assembled).
            rank: for such a version, whose state to get.

        Returns:
            The new tree, or ``into`` updated.

        Raises:
            RefNotFoundError, AmbiguousRefError: bad ref.
            RestoreTargetError: ``into`` does not match the stored state, or a version
                saved rank by rank without ``group``/``rank`` (or with another group size).
            CorruptChunkError, MissingDataError: stored data is damaged or gone.
        """
        from casckpt.engine import restore as restore_engine  # torch: see commit

        manifest = self._distributed.rank_manifest(self._core.manifest(ref), group, rank)
        if into is None:
            return restore_engine.materialize(self._core.ctx, manifest, map_location=map_location,
                                              progress=progress)
        return restore_engine.restore_into(self._core.ctx, manifest, into, map_location=map_location,
                                           progress=progress)

    def load_tensor(self, ref: Ref, path: str, *, map_location: Any = None) -> torch.Tensor | np.ndarray:
        """Read one tensor (dotted path, e.g. ``model.layers.0.weight``), fetching only its chunks.

        A tensor sharded across ranks comes back whole; in a version saved rank
        by rank, ``rank1/model.weight`` names rank 1's tensor.

        Raises:
            TensorNotFoundError: no tensor at ``path`` (near matches listed).
        """
        from casckpt.engine import restore as restore_engine  # torch: see commit

        row = self._core.readable_row(ref)
        head = bind(row, decode_manifest(self._core.ctx.catalog.manifest(row.id), row.id))
        if head.tree is not None:  # only the nodes on the way to the tensor are read
            found = treeviews.Trees(self._core.ctx.catalog).entry(head, path)  # validated
            if found is not None:
                entry, extents = found
                one = replace(head, root={"t": "tensor", "i": 0}, tensors=(entry,), extents=tuple(extents))
                return restore_engine.load_tensor(self._core.ctx, one, entry.path, map_location)
        manifest, path = self._distributed.tensor_manifest(load_manifest(self._core.ctx.catalog, row), path)
        return restore_engine.load_tensor(self._core.ctx, manifest, path, map_location)

    # -- queries ------------------------------------------------------------

    def resolve(self, ref: Ref) -> Version:
        """The version a ref names."""
        return self._queries.resolve(ref)

    def log(
        self, run: str | None = None, *, limit: int | None = None,
        since: datetime | float | None = None, until: datetime | float | None = None,
        min_step: int | None = None, max_step: int | None = None, tag: str | None = None,
        where: str | Iterable[str] | None = None, order: str = "desc",
    ) -> list[Version]:
        """Versions of ``run`` (all runs if None) that pass every filter given, newest first.

        Served by one SQL query (plus one for tags), however many versions match.

        Args:
            run: only this run; versions are then ordered by step, else by creation time.
            limit: at most this many versions (after ordering): 0 to 2**63 - 1.
            since: creation time lower bound, inclusive (datetime, naive = local
                time, or epoch seconds).
            until: creation time upper bound, inclusive (as ``since``).
            min_step: lowest step, inclusive.
            max_step: highest step, inclusive.
            tag: only the version this tag points at.
            where: predicates that must all hold, ``NAME OP VALUE`` with OP one of
                ``< <= > >= == !=``; NAME a metric (``"loss<2.1"``) or
                ``metadata.KEY`` / ``meta.KEY`` (``"metadata.optimizer==adamw"``).
                Numbers compare numerically, other values as strings; versions
                lacking NAME never match.
            order: ``"desc"`` (newest / highest step first) or ``"asc"``.

        Raises:
            RefNotFoundError: no such run or tag (near names suggested).
            InvalidArgumentError: a bad limit, bound, order or predicate (the
                message gives the predicate grammar).
        """
        return self._queries.log(run, limit=limit, since=since, until=until, min_step=min_step,
                                 max_step=max_step, tag=tag, where=where, order=order)

    def show(self, ref: Ref, *, tensors: bool = True) -> VersionDetail:
        """A version with its tensors (in natural order: ``layers.2`` before ``layers.10``),
        plain values (from its manifest), and whether it is degraded now (see
        :class:`~casckpt.types.VersionDetail`).

        ``tensors=False`` leaves the per-tensor list out (``tensors`` is empty) and fills
        only the summary (``tensor_count``, ``tensor_bytes``, ``tensor_groups``): what
        ``casckpt show`` prints by default, without a row per tensor of a 100,000-tensor state.
        """
        return self._queries.show(ref, tensors=tensors)

    def run(self, name: str, *, retention: RetentionPolicy | Mapping[str, Any] | None = None,
            redundancy: str | None = None, delta_chain: int | None = None,
            save_every: int | timedelta | tuple[int, timedelta] | None = None) -> Run:
        """A handle on run ``name``: ``save``, ``restore``, ``should_save`` and the rest without
        repeating ``run=`` (see :class:`casckpt.run.Run`). The policies given are stored for
        the run now (as ``set_retention``, ``set_redundancy``, ``set_delta_chain``: creating
        the run); ``save_every`` (steps, a timedelta, or both) is what ``should_save`` asks.

        Raises:
            InvalidNameError: bad run name.
            InvalidArgumentError: a bad ``save_every`` or policy, naming it.
        """
        check_name(name, "run")
        handle = Run(self, name, save_rule(save_every))
        if retention is not None:
            set_policy(self, name, retention)
        if redundancy is not None:
            self.set_redundancy(redundancy, run=name)
        if delta_chain is not None:
            self.set_delta_chain(delta_chain, run=name)
        return handle

    def runs(self) -> list[RunInfo]:
        """Every run with a summary of its versions."""
        return self._queries.runs()

    def tags(self, run: str | None = None) -> list[TagInfo]:
        """Every tag with the version it points at, sorted by name (``casckpt tags``).

        Args:
            run: only the tags pointing at this run's versions.

        Only tags of visible versions are listed: a deleted version's tags come back with
        :meth:`undelete`.

        Raises:
            RefNotFoundError: no such run (near names suggested).
        """
        return self._queries.tags(run)

    def tag(self, ref: Ref, name: str) -> Version:
        """Point tag ``name`` at the version ``ref`` names (moving it if it exists)."""
        self._core.refuse_write("tag", "the catalog")
        return self._queries.tag(ref, name)

    def gc(self, *, dry_run: bool = False, grace: float | timedelta | None = None,
           force: bool = False, progress: ProgressCallback | None = None) -> GCReport:
        """Apply every run's retention policy, then reclaim space no version needs.

        Safe while other processes commit and restore (see
        :mod:`casckpt.engine.gc`). Only one GC runs at a time.

        Args:
            dry_run: report what would happen; delete nothing. On a read-only store
                it plans retention only (``GCReport.space_counted`` is False).
            grace: how long deleted versions stay undeletable and unreferenced
                data stays in place (seconds or timedelta; default 6 hours).
                ``0`` reclaims at once (tests, or when no reader is active).
            force: delete even when the locations hold manifests the catalog does
                not know, or many objects of unknown packs (the circuit breakers of
                :mod:`casckpt.engine.gcguard`); never without the store's identity.

        GC deletes an object only with positive proof that it is garbage (see
        :mod:`casckpt.engine.gcguard`); objects it could not prove are left in
        place and listed in ``GCReport.kept``.

        Raises:
            GCRunningError: another GC holds the lock.
            GCRefusedError: deleting is not proven safe; nothing was changed.
            StorageError, CatalogError: listing or the catalog failed; GC
                stopped without deleting any object it had not already
                unlinked from the catalog.
        """
        if not dry_run:
            self._core.refuse_write("gc", "the catalog and the locations (it deletes from both)")
        return self._retention.gc(dry_run=dry_run, grace=grace, force=force, progress=progress)

    def gc_history(self, *, since: datetime | float | None = None) -> list[GCRun]:
        """The gc runs (not dry runs) started since ``since`` (a datetime or epoch seconds;
        None: all), oldest first, each with what it committed to the catalog.

        A run's counts are written in the transactions that delete what they count, so a run
        killed with -9 or failing is counted too -- unlike the ``gc --json`` lines, which such
        a run never prints. Sum these for the true totals over a day of cron runs.
        """
        when = since.timestamp() if isinstance(since, datetime) else since
        return self._retention.gc_history(when)

    # -- retention ----------------------------------------------------------

    def set_retention(
        self, run: str, *, keep_last: int | None = None, keep_every: int | None = None,
        keep_hourly: int | None = None, keep_daily: int | None = None, keep_weekly: int | None = None,
        keep_within: float | timedelta | str | None = None,
        keep_best: tuple[str, int, str] | None = None, keep_tagged: bool = True,
    ) -> RetentionPolicy:
        """Store the retention policy of ``run`` (replacing any); :meth:`gc` applies it.

        Rules combine as in restic's ``forget``: a version is kept if ANY rule
        keeps it (semantics in :mod:`casckpt.engine.retention`). ``keep_within``
        is a timedelta, seconds, or a string like ``"7d"``; ``keep_best`` is
        ``(metric, n, "min" | "max")``. Fork points of live runs are always
        kept. A run that does not exist yet is created, so a training
        script may set its policy before its first commit.

        Raises:
            InvalidNameError: bad run name.
            InvalidArgumentError: a value is not positive, or no keep rule is
                given (``keep_tagged`` alone would delete every untagged version).
        """
        self._core.refuse_write("set_retention", "the catalog")
        return self._retention.set_retention(
            run, keep_last=keep_last, keep_every=keep_every, keep_hourly=keep_hourly,
            keep_daily=keep_daily, keep_weekly=keep_weekly, keep_within=keep_within,
            keep_best=keep_best, keep_tagged=keep_tagged)

    def retention(self, run: str) -> RetentionPolicy | None:
        """The retention policy of ``run``; None when it has none (it keeps every version).

        Raises:
            RefNotFoundError: there is no such run.
        """
        return self._retention.retention(run)

    def clear_retention(self, run: str) -> None:
        """Remove the retention policy of ``run``: it keeps every version again. Idempotent.

        Raises:
            RefNotFoundError: there is no such run.
        """
        self._core.refuse_write("clear_retention", "the catalog")
        self._retention.clear_retention(run)

    def plan_retention(self, run: str | None = None) -> list[RetentionPlan]:
        """What retention would do, writing nothing: a decision per visible version, with reasons.

        With ``run``: that run's plan (every version kept when it has no
        policy); without: a plan for every run that has a policy, by name.
        Bytes freed need a mark over the whole store: ``gc(dry_run=True)`` reports them.

        Raises:
            RefNotFoundError: there is no such run.
            CatalogError: a stored policy is malformed.
        """
        return self._retention.plan_retention(run)

    def delete(self, ref: Ref, reason: str = "manual") -> Version:
        """Soft-delete a version: it leaves refs, log and show at once; GC reclaims its data later.

        :meth:`undelete` brings it back until GC sweeps its chunks (after the
        grace period). Returns the version as it was. An explicit delete
        removes tagged versions and fork points too (retention never does);
        their tags stay and come back with :meth:`undelete`.

        Raises:
            RefNotFoundError, AmbiguousRefError: bad ref.
            InvalidArgumentError: ``reason`` is not a non-empty str.
        """
        self._core.refuse_write("delete", "the catalog")
        return self._retention.delete(ref, reason)

    def undelete(self, ref: str | Version) -> Version:
        """Make a deleted version visible again, exactly as it was (tags included).

        Args:
            ref: the deleted version's id, a unique prefix of it, or ``run@step``.

        Raises:
            RefNotFoundError, AmbiguousRefError: no (single) deleted version matches.
            VersionSweptError: GC already swept some of its data; it is gone.
        """
        self._core.refuse_write("undelete", "the catalog")
        return self._retention.undelete(ref)

    # -- history and lineage ------------------------------------------------

    def diff(self, a: Ref, b: Ref) -> VersionDiff:
        """What changed from version ``a`` to version ``b``: tensors and plain values.

        Tensors are compared by content digest; changed bytes come from
        comparing chunk lists (see :class:`casckpt.types.TensorChange`), so no
        tensor data is read. Plain values come from the manifests the catalog keeps.

        Raises:
            RefNotFoundError, AmbiguousRefError: bad ref.
        """
        return self._queries.diff(a, b)

    def history(self, run: str, path: str) -> list[TensorHistoryEntry]:
        """The versions of ``run`` in which the tensor at ``path`` changed, by step.

        Its first appearance counts as a change; so does its removal (an entry
        with ``change="removed"``). A forked run's history starts in the run it
        was forked from, up to the fork point.

        Raises:
            RefNotFoundError: no such run.
            TensorNotFoundError: no version has a tensor at ``path`` (near paths of
                the latest version suggested).
        """
        return self._queries.history(run, path)

    def fork(self, ref: Ref, run: str) -> RunInfo:
        """Create run ``run`` branching from the version ``ref`` names (fine-tunes, sweeps).

        The first version committed to ``run`` gets that version as its parent;
        ``run`` has no versions until then. Retention keeps fork points.

        Raises:
            InvalidNameError: bad run name.
            RunExistsError: a run named ``run`` exists.
            RefNotFoundError, AmbiguousRefError: bad ref.
        """
        self._core.refuse_write("fork", "the catalog")
        return self._queries.fork(ref, run)

    def tree(self) -> list[RunNode]:
        """Every run with its fork point and forks, depth first (root runs by name)."""
        return self._queries.tree()

    def best(self, run: str, metric: str, mode: str = "min") -> Version:
        """The visible version of ``run`` with the lowest (``mode="min"``) or highest
        (``"max"``) value of ``metric``; ties go to the latest step.

        Raises:
            RefNotFoundError: no such run.
            MetricNotFoundError: no version of ``run`` records ``metric``.
            InvalidArgumentError: ``mode`` is not "min" or "max".
        """
        return self._queries.best(run, metric, mode)

    # -- storage administration ---------------------------------------------

    def redundancy(self, run: str | None = None) -> str:
        """The redundancy new packs get: the store's, or ``run``'s own if it has one."""
        return self._admin.redundancy(run)

    def set_redundancy(self, spec: str, *, run: str | None = None) -> str:
        """Set the redundancy of new packs: ``"none"``, ``"replicate:N"`` or ``"ec:K+M"``.

        For the whole store, or for one run (``run=``; ``spec=None`` is not
        accepted here: use ``"inherit"`` to make a run follow the store again).
        Packs already stored keep their scheme.

        Raises:
            InvalidArgumentError: a bad spec, or more shards than active failure domains.
        """
        self._core.refuse_write("set_redundancy", "the catalog and the locations")
        return self._admin.set_redundancy(spec, run=run)

    def locations(self, *, timeout: float | None = None) -> list[LocationInfo]:
        """Every blob location with its failure domain, state, what it holds, and its health.

        Health is measured: each location (failed ones too, to tell whether one came
        back) is sent a real request -- a read of its identity record -- all at once,
        and ``reachable`` says whether it answered with this store's record within
        ``timeout`` seconds (default: the ``probe_timeout_s`` setting, 5 s), with
        ``reason`` why not and ``probe_s`` how long it took. The call returns after at
        most about ``timeout`` seconds, however many locations are silent.

        Raises:
            InvalidArgumentError: ``timeout`` is not a number of seconds from 0 to an hour.
        """
        return self._admin.locations(timeout=timeout)

    def add_location(self, url: str, *, domain: str | None = None, name: str | None = None) -> LocationInfo:
        """Add a blob location (a directory, ``file:///``, ``s3://``); new packs may use it at once.

        Recorded in the catalog (every host sees it) and in this store's
        config file. It receives a copy of every manifest and ``refs/``
        record at once (what a catalog rebuild needs). Existing packs stay
        where they are; ``repair`` uses the new location for shards it has
        to re-place.

        Raises:
            InvalidArgumentError: the name or URL is taken, or the location cannot be opened.
            StoreIdentityError: the location holds another store's data (or data this
                catalog knows nothing of); nothing was changed.
        """
        self._core.refuse_write("add_location", "the catalog and the locations")
        return self._admin.add_location(url, domain=domain, name=name)

    def keys(self) -> list[KeyInfo]:
        """The master keys of an encrypted store: each key's public id, when and by whom it
        was added, and whether this handle was opened with it (never the keys themselves).

        Raises:
            NotEncryptedError: the store is not encrypted.
        """
        return self._admin.keys()

    def add_key(self, key_file: str | os.PathLike[str]) -> KeyInfo:
        """Let the master key in ``key_file`` open this encrypted store too.

        The store's data key is wrapped under the new key and the key record rewritten
        (in the catalog and on every location); no data is rewritten. Make a key file with
        :func:`casckpt.generate_key_file` (`casckpt key generate FILE`).

        Raises:
            NotEncryptedError: the store is not encrypted.
            StoreKeyError: ``key_file`` is not a key file.
            InvalidArgumentError: the key is one of the store's already.
        """
        return self._admin.add_key(key_file)

    def remove_key(self, key_id: str) -> None:
        """Remove master key ``key_id`` (see :meth:`keys`): it no longer opens the store.

        A copy of the key record taken before (a backup of the catalog or a location)
        still opens with the removed key: rotate keys you believe stolen *and* treat old
        backups of the catalog and the ``casckpt-keys`` objects as holding the old key.

        Raises:
            LastKeyError: it is the store's only key (nothing would open the store).
            InvalidArgumentError: the store has no key of that id.
        """
        self._admin.remove_key(key_id)

    def rotate_key(self, new_key_file: str | os.PathLike[str], old: str | None = None) -> KeyInfo:
        """Replace master key ``old`` (default: the one this handle was opened with) by the
        key in ``new_key_file``, in one change of the key record; no data is rewritten.

        Raises:
            NotEncryptedError: the store is not encrypted.
            InvalidArgumentError: ``old`` is not one of its keys, or the new key is already.
        """
        return self._admin.rotate_key(new_key_file, old)

    def drain_location(self, name: str) -> LocationInfo:
        """Stop writing to a location; ``repair`` then moves its shards to others (``gc``
        deletes the old objects after its grace period)."""
        self._core.refuse_write("drain_location", "the catalog and the locations")
        return self._admin.drain_location(name)

    def fail_location(self, name: str) -> LocationInfo:
        """Declare a location lost: it is never read again; ``repair`` re-creates its shards elsewhere."""
        self._core.refuse_write("fail_location", "the catalog")
        return self._admin.fail_location(name)

    def activate_location(self, name: str) -> LocationInfo:
        """Return a drained or failed location to service (its shards count again once verified)."""
        self._core.refuse_write("activate_location", "the catalog")
        return self._admin.activate_location(name)

    def check(self, *, read_data: bool = False, read_data_subset: float | str | None = None,
              progress: ProgressCallback | None = None) -> CheckReport:
        """Check the catalog against the blob locations.

        Args:
            read_data: read every pack in full: verify each shard and every chunk.
            read_data_subset: scrub only this share of the stored bytes (``"5%"``,
                ``0.05``), least recently verified packs first; a cron job running
                ``check --read-data-subset 5%`` daily verifies everything every 20 days.

        Damaged shards found are queued for :meth:`repair`. Data is never modified.
        """
        return self._admin.check(read_data=read_data, read_data_subset=read_data_subset, progress=progress)

    def repair(self, *, progress: ProgressCallback | None = None) -> RepairReport:
        """Rebuild lost or corrupt shards and move shards off draining or failed locations.

        Safe while other processes commit, restore and collect garbage.
        """
        self._core.refuse_write("repair", "the catalog and the locations")
        return self._admin.repair(progress=progress)

    def audit(self, *, since: datetime | float | None = None, until: datetime | float | None = None,
              action: str | None = None, target: str | None = None,
              limit: int | None = None) -> list[AuditEntry]:
        """The store's audit trail: who changed what, and when, oldest first.

        Every commit, delete and undelete, tag, run created or forked, gc that changed
        anything (not dry runs), retention policy change, location change, repair, catalog
        rebuild and schema migration leaves one row, written in the transaction that made the
        change (see :class:`~casckpt.types.AuditEntry` and docs/guides/audit.md). gc never
        deletes rows.

        Args:
            since: the inclusive lower time bound (datetime, naive = local time, or epoch seconds).
            until: the inclusive upper time bound (as ``since``).
            action: an action (``"commit"``), or a family (``"location"``: every ``location.*``).
            target: a version id (or a prefix of 4+ hex digits), ``run:NAME``, ``tag:NAME``,
                ``location:NAME``.
            limit: only the newest ``limit`` rows (still oldest first).

        Raises:
            InvalidArgumentError: a bad bound, filter or limit.
        """
        return self._queries.audit(since=since, until=until, action=action, target=target, limit=limit)

    def drill(self, runs: str | Iterable[str] | None = None, count: int = 3, seed: int | None = None,
              progress: ProgressCallback | None = None) -> DrillReport:
        """A restore drill: read versions back as a restart would, and record what happened.

        Picks the latest version of each run in ``runs`` (every run: None), then random older
        visible versions (``seed``: a repeatable choice) up to ``count`` in all, and restores
        each one into memory through the verified path :meth:`restore` takes (every byte
        checked against its id; nothing written to disk), timing it. A version that does not
        restore -- damaged or missing data, a lost version, one not drained from a fast tier
        yet -- is a failed result with the error's message; the drill goes on to the next.

        The results go to the catalog's ``drills`` table in one transaction, with a ``drill``
        row in the audit trail (:meth:`drill_history` reads them); a read-only store drills
        and records nothing (``DrillReport.recorded`` False). Nothing else in the store
        changes: reads do not heal what they find (``casckpt repair`` does; a damaged shard
        of a pack with redundancy is marked for it, as ``check`` marks it).

        ``progress`` gets ``("drill", versions done, versions)`` and each restore's ``read``.
        Each version is held in memory whole while it is checked (one at a time).

        Raises:
            RunNotFoundError: a run in ``runs`` does not exist.
            VersionNotFound: a run in ``runs`` has no version to drill (a restart of it
                would have nothing to restore; nothing is recorded).
            InvalidArgumentError: ``count`` is not a positive int.
            CatalogError: the results could not be recorded.
        """
        return self._drills.drill(runs, count, seed, progress)

    def drill_history(self, limit: int | None = 100, run: str | None = None) -> list[DrillResult]:
        """Past drills' results, newest first: at most ``limit`` (None: all), of ``run`` only
        when given.

        Raises:
            InvalidArgumentError: ``limit`` is not None or an int from 1 to 2**63 - 1.
        """
        return self._drills.drill_history(limit, run)

    def advise(self, run: str, *, mtbf: Duration, restart: Duration = 0.0) -> Advice:
        """The checkpoint interval that minimises the time ``run`` loses to checkpoints and
        failures (Young 1974, Daly 2006; :mod:`casckpt.engine.advise` has the formulas and
        their assumptions), from what the run measured: the median stall of its last 20
        commits (``Version.stall_s``), the median time of its successful drills (or, with
        none, one restore of its latest version measured now, unrecorded), plus ``restart``.

        Args:
            run: the run.
            mtbf: mean time between failures of the job: seconds, a timedelta or text
                (``"8h"``), from 1 s to 100 years.
            restart: time to get the job running again before the restore (``"5m"``), from 0
                to 100 years.

        Raises:
            RunNotFoundError: no such run.
            InvalidArgumentError: ``mtbf`` or ``restart`` not a duration or out of its range
                (``casckpt advise`` refuses the same text the same way), or the run has fewer
                than 2 commits with a recorded stall.
            IntegrityError, VersionLostError, ...: the restore measured failed (the run's
                latest version does not restore: see ``casckpt drill``).
        """
        return self._drills.advise(run, mtbf, restart)

    def stats(self) -> StoreStats:
        """Space accounting: logical vs unique vs stored bytes, and what delta coding saved."""
        return self._admin.stats()

    def report(self, path: str | os.PathLike[str], runs: Iterable[str] | None = None) -> Path:
        """Write a self-contained HTML report of the store to ``path`` and return it.

        Plots (inline SVG, light and dark mode, each with its data as a table): space saved
        by dedup and delta coding, new bytes per commit, metric curves with tagged and best
        versions marked, the lineage of runs and forks, storage by run, versions by
        durability, commit stalls, gc history, location health (probed now) and restore
        drills. ``runs`` limits the per-run plots to those runs (default: every run).
        Read-only: a read-only store can report. Needs the ``report`` extra (matplotlib).

        Raises:
            OptionalDependencyError: matplotlib is not installed (``pip install 'casckpt[report]'``).
            RefNotFoundError: a run in ``runs`` does not exist.
            InvalidArgumentError: ``runs`` is not a list of run names, or ``path`` exists and is
                not a file (a folder, a pipe: never replaced).
        """
        from casckpt.report import write_report  # matplotlib: only when a report is asked for

        chosen = None if runs is None else ([runs] if isinstance(runs, str) else list(runs))
        title = f"casckpt store {self.path}" if self.path is not None else "casckpt store"
        return write_report(self, path, chosen, title=title)

    def delta_chain(self, run: str | None = None) -> int:
        """Deltas deep a chunk may be stored before a keyframe (0: no delta coding): the
        store's, or what commits to ``run`` use (its own, else the store's)."""
        return self._admin.delta_chain(run)

    def set_delta_chain(self, chain: int, *, run: str | None = None) -> None:
        """Set how many deltas deep a chunk may be stored before a keyframe (0: no delta coding),
        for the whole store or (``run``) one run; ``run`` with ``chain=-1`` follows the store again.

        Longer chains store less (a chunk that changes a little each commit costs only its
        delta) but restoring the end of a chain decodes every delta down from its keyframe.

        Raises:
            InvalidArgumentError: ``chain`` is out of range.
        """
        self._core.refuse_write("set_delta_chain", "the catalog")
        self._admin.set_delta_chain(chain, run=run)

    def rebuild_catalog(self, *, progress: ProgressCallback | None = None) -> RebuildReport:
        """Recreate an empty catalog from the blob locations alone (see
        :mod:`casckpt.engine.rebuild`).

        Raises:
            InvalidArgumentError: the catalog is not empty.
        """
        self._core.refuse_write("rebuild_catalog", "the catalog and the locations")
        return self._admin.rebuild_catalog(progress=progress)

    def migrate_trees(self, *, progress: ProgressCallback | None = None) -> MigrationReport:
        """Give every version of manifest format 1 (written before tree manifests) its tree, so
        queries read it as a tree and its ``tensors`` rows go (see
        :mod:`casckpt.engine.treemigrate`). Version ids and restores do not change.

        Resumable and idempotent (run it again after an interruption; a second run does
        nothing); safe while other processes commit, restore and run gc. ``open`` never runs
        it: on a large store it takes a while.

        Raises:
            CatalogError: nodes kept disappearing under a gc with grace 0; run it again.
            StorageError: nodes could not be written (the batches done so far stay done).
        """
        self._core.refuse_write("migrate_trees", "the catalog and the locations")
        return self._admin.migrate_trees(progress=progress)

    def rebuild_cache(self) -> int:
        """Drop and refill this host's index cache from the catalog; returns the chunks cached."""
        self._core.refuse_write("rebuild_cache", "this host's index cache")
        return self._admin.rebuild_cache()

    # -- many ranks ---------------------------------------------------------

    def dcp_writer(self, *, run: str, step: int, metadata: Mapping[str, Any] | None = None,
                   metrics: Mapping[str, float] | None = None, message: str | None = None,
                   tags: Iterable[str] = ()) -> StoreWriter:
        """A ``torch.distributed.checkpoint`` StorageWriter that saves version ``run@step``.

        Call on every rank (each with its own open store), then pass it to
        ``dcp.save`` / ``dcp.async_save``: every rank writes its own chunks
        (only new ones), and the version becomes visible in one catalog
        transaction once every rank succeeded (see :mod:`casckpt.dcp`). Use a
        new writer for every checkpoint.

        Raises:
            InvalidNameError, InvalidArgumentError: bad run/tag name, step, metadata or metrics.
        """
        self._core.refuse_write("a DCP save (dcp_writer)", "the catalog and the locations")
        return self._distributed.dcp_writer(run=run, step=step, metadata=metadata, metrics=metrics,
                                            message=message, tags=tags)

    def dcp_reader(self, ref: Any) -> StoreReader:
        """A ``torch.distributed.checkpoint`` StorageReader for the version ``ref`` names.

        ``dcp.load`` with it reshards onto any number of ranks, each reading only
        the chunks its pieces need. Works for versions saved by ``dcp.save`` and
        by :meth:`commit` (not those saved rank by rank with ``group=``).

        Raises:
            RefNotFoundError, AmbiguousRefError: bad ref.
            RestoreTargetError: the version was saved rank by rank.
        """
        return self._distributed.dcp_reader(ref)

"""The Store facade: the training and query surface of one open store, and its namespaces.

:class:`Store` answers what a training loop and a person looking at checkpoints ask: commit,
restore, load a tensor, directory snapshots, imports and exports, DCP writers and readers,
run handles and gc. The version history (log, show, diff, history, tags, forks, lineage,
delete and undelete) is declared in its base class :class:`~casckpt.store_history.StoreHistory`.
Everything else lives in a namespace named by its concept, one module each (``locations``,
``keys``, ``tier``, ``retention``, ``ops``: see :class:`Store`'s attributes). All of them share
one :class:`~casckpt.store_core.StoreCore` (engine context, pools, committer, close), the one
place the components are built. A ``Store`` is thread-safe: concurrent commits
and restores from several threads share its pools (the catalog serialises what must be serial).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, overload

from casckpt.engine.versions.validate import check_name
from casckpt.engine.write.commithandle import CommitHandle
from casckpt.errors import (
    CasckptError,
    CheckoutMismatchError,
    CommitTimeoutError,
    CopyTargetError,
    InvalidArgumentError,
)
from casckpt.run import Run, save_rule, set_policy
from casckpt.storage import redact_url
from casckpt.store_core import Ref, StoreCore
from casckpt.store_history import StoreHistory
from casckpt.store_keys import Keys
from casckpt.store_locations import Locations
from casckpt.store_mirrors import Mirrors, Opener
from casckpt.store_ops import Ops
from casckpt.store_retention import Retention
from casckpt.store_tier import Tier
from casckpt.types import CopyReport, GCReport, ProgressCallback, RetentionPolicy, Version

if TYPE_CHECKING:
    import numpy as np
    import torch

    from casckpt.dcp import StoreReader, StoreWriter
    from casckpt.engine.transfer.exporters import DirExport
    from casckpt.engine.write.commit import CommitRequest
    from casckpt.engine.write.hint import PathSpec

log = logging.getLogger(__name__)


class Store(StoreHistory):
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
        state is copied into host staging reused across commits (a memcpy; the
        staging holds the state's size, within ``commit_memory``). From then on the
        caller may mutate its tensors; hashing and the rest run in the background, in
        commit order (``handle.id`` waits for the hash). ``handle.wait()``
        returns the version or raises why it failed; a failure nobody waited
        for is raised by the next commit or by :meth:`close`. Bounds and
        backpressure: ``max_pending_commits``, ``commit_memory`` and
        ``backpressure`` of :func:`casckpt.open` (see
        :mod:`casckpt.engine.write.background`).

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

        Such tensors are not read: the version reuses the parent's chunk ids for them. With
        ``block=False``, the tensors ``trust_versions`` vouches for are not copied either
        while the staging holds them as they are (``unchanged`` tensors are copied: the
        promise is about the parent version, not the staging). A hint is ignored, and every
        tensor hashed, when the run's last commit in this process made no version (it
        failed or was refused) or another commit of the run came after it. A
        tensor the hint names that is new to the run (or shares storage, or is packed
        with small neighbours) is hashed as usual. **A wrong hint is not refused**: the
        version then holds (and restores) the previous version's bytes for that tensor.
        The commit records a fingerprint of a sample of each reused tensor's bytes (16
        blocks of 4 KiB, the whole tensor up to 64 KiB; at most 64 KiB hashed per tensor),
        and ``check(read_data=True)`` reports a version whose stored bytes do not match
        (a ``hint`` problem); a sparse change outside the sample is missed (see
        docs/ARCHITECTURE.md, "Change hints", for the odds).

        With a fast tier (``casckpt.open(..., fast_tier=DIR)``) the commit returns once its
        packs and manifest are on the tier (fsync'd) and the version is published with
        ``durability="fast"``; the drain makes it ``"durable"`` in the background.
        ``durable=True`` returns only once it is (blocking commits; for a background one,
        ``store.tier.wait_durable(handle.wait())``).

        Raises:
            UnsupportedStateError: the tree holds an unsupported object (nothing written).
            InvalidNameError, InvalidArgumentError: bad run/tag name, step, metadata or metrics.
            VersionExistsError: ``run`` already has a version at ``step`` (with ``block=False``
                raised by the handle, whose worker asks the catalog; a step still in flight
                in this process, or taken by a state over ``commit_memory``, is refused at once).
            StorageError, CatalogError: the blob store or catalog failed, or too few
                locations are active for the run's redundancy (with ``block=False`` raised by
                the handle); the version is not visible and the store stays consistent.
            GroupCommitError: with ``group``, some rank failed (raised on every rank).
            ChangeHintError: a tensor declared ``unchanged`` has another dtype or shape than
                in the previous version (nothing written; with ``block=False`` raised by the
                handle, whose worker compares them).
        """
        from casckpt.engine.write import commit as commit_engine  # torch: only where tensors are handled
        from casckpt.engine.write.hint import make_hint

        if group is not None:
            if make_hint(unchanged, trust_versions) is not None:
                raise InvalidArgumentError("group commits take no change hint (unchanged=, "
                                           "trust_versions=); commit without it")
            if not block:
                raise InvalidArgumentError(
                    "group commits block; for a background save of many ranks use "
                    "dcp.async_save(state, storage_writer=store.dcp_writer(run=..., step=...))"
                )

            def request() -> CommitRequest:  # on every rank, inside the first collective step:
                # a rank refused here (a read-only store on one host) makes every rank raise
                self._core.refuse_write("commit", "the catalog and the locations")
                req = commit_engine.make_request(run, step, metadata, metrics, message, tags)
                self._core.refuse_while_recovering("commit")
                self._core.refresh_locations()
                self._core.committer.raise_unreported()  # a background failure nobody saw yet
                self._core.committer.wait_all()  # versions of a run appear in commit order
                self._core.committer.forget(req.run)  # a later background commit copies all
                return req

            from casckpt.engine.write.group import group_commit

            return group_commit(self._core.ctx, state, request, group, progress)
        self._core.refuse_write("commit", "the catalog and the locations")
        req = commit_engine.make_request(run, step, metadata, metrics, message, tags)
        hint = make_hint(unchanged, trust_versions)
        self._core.refuse_while_recovering("commit")
        self._core.refresh_locations()
        if not block:
            if durable:
                raise InvalidArgumentError("durable=True needs block=True; for a background commit "
                                           "call store.tier.wait_durable(handle.wait())")
            return self._core.committer.commit(state, req, progress, hint)
        version = self._core.committer.foreground(
            lambda: commit_engine.commit(self._core.ctx, state, req, progress, hint), of=req.run)
        if durable and version.durability != "durable":
            self.tier.wait_durable(version)
            version = replace(version, durability="durable")
        return version

    def pending_commits(self) -> list[CommitHandle]:
        """Background commits not finished yet, oldest first."""
        committer = self._core.started_committer  # none yet: nothing was committed
        return committer.pending() if committer is not None else []

    def wait_commits(self, timeout: float | None = None) -> None:
        """Wait for every background commit; raise the first failure nobody waited on.

        Raises:
            CommitTimeoutError: ``timeout`` seconds passed with commits still running.
            BackgroundCommitError: a background commit failed unseen.
        """
        committer = self._core.started_committer
        if committer is None:  # nothing was committed through this handle
            return
        if not committer.wait_all(timeout):
            raise CommitTimeoutError(f"background commits still running after {timeout} s")
        committer.raise_unreported()

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
        """Store the directory at ``path`` as version ``run@step``, byte-identical.

        Every directory, regular file and symbolic link is recorded: relative name, permission
        bits, size, bytes, a whole-file BLAKE3, and for a link its target text (links are never
        followed). Files are cut where their format says (safetensors tensor by tensor, zip
        archives such as ``torch.save`` output entry by entry, anything else by content-defined
        chunking), so what an earlier version holds is not written again (see
        :mod:`casckpt.format.segments`). :meth:`checkout` writes it back.

        The files are read through memory maps until the commit has read them: they must not
        change until this returns (with ``block=False`` too: the returned handle's commit has
        copied or hashed them by then). The version's metadata records ``"casckpt.dir"``: the
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
        from casckpt.engine.transfer.dirscan import scan
        from casckpt.engine.write import commit as commit_engine  # torch: only where tensors are handled
        from casckpt.format.dirsnap import DIR_KEY

        if metadata is not None and DIR_KEY in metadata:
            raise InvalidArgumentError(f"metadata key {DIR_KEY!r} is reserved for the directory "
                                       "summary add_dir records; rename it")
        commit_engine.make_request(run, step, metadata, metrics, message, tags)  # refuse before reading
        if self.path is not None and Path(os.path.realpath(self.path)).is_relative_to(os.path.realpath(path)):
            raise InvalidArgumentError(
                f"the store {str(self.path)!r} is inside {str(path)!r}, which would change while it is "
                "read; add a directory that does not hold the store")
        state, counts = scan(path, progress, self._core.crypto.file_hasher)
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
        (:mod:`casckpt.engine.read.dircompare`; nothing is written). Everything is written into a
        temporary sibling, every file checked against its BLAKE3, and renamed onto ``path`` at
        the end, so ``path`` either holds the whole snapshot or is left as it was. Reads are
        streamed (at most ``BATCH_BYTES`` of :mod:`casckpt.engine.read.checkout` at a time);
        ``progress`` gets ``("write", bytes, total)``.
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
        from casckpt.engine.read import checkout as checkout_engine  # torch: reads go through restore

        target = Path(path)
        if reuse and target.is_dir() and not target.is_symlink() and checkout_engine.holds_entries(target):
            from casckpt.engine.read.dircompare import first_difference

            manifest = self._core.manifest(ref)
            difference = first_difference(self._core.ctx, manifest, target)
            if difference is not None:
                raise CheckoutMismatchError(
                    f"{str(target)!r} does not hold {manifest.run}@{manifest.step}: {difference}; "
                    "nothing was touched. Move it away and check out again.")
            return Path(os.path.abspath(target))
        checkout_engine.check_target(Path(os.path.abspath(target)))  # before the manifest is read
        return checkout_engine.checkout(self._core.ctx, self._core.manifest(ref), target, progress)

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
        or a Hugging Face model directory; :mod:`casckpt.engine.transfer.importers` gives the state
        each becomes. Nothing in the file runs code.

        Raises:
            UnsafeCheckpointError: a pickle needs code execution to load (nothing committed).
            UnreadableCheckpointError: ``path`` is of no supported kind, or damaged or forged
                (nothing committed).
            UnsupportedStateError: the loaded state holds an object a version cannot hold.
            And what :meth:`commit` raises.
        """
        self._core.refuse_write("import_checkpoint", "the catalog and the locations")
        from casckpt.engine.transfer.importers import read_checkpoint
        from casckpt.engine.write import commit as commit_engine

        commit_engine.make_request(run, step, metadata, metrics, message, tags)  # bad names: before reading
        state = read_checkpoint(Path(path))
        return self.commit(state, run=run, step=step, metadata=metadata, metrics=metrics,
                           message=message, tags=tags, progress=progress)

    def export(self, ref: Ref, to: str | Path, *, format: str = "safetensors",
               overwrite: bool = False, progress: ProgressCallback | None = None) -> DirExport:
        """Write version ``ref`` into directory ``to`` as ``format``: ``"safetensors"``
        (``model.safetensors``; a version imported from a Hugging Face directory becomes such a
        directory again), ``"dcp"`` (a ``torch.distributed.checkpoint`` directory) or ``"pt"``
        (``checkpoint.pt``); or, as ``"safetensors-file"``, into the one file ``to`` (plain
        values in its metadata, or a sidecar); layouts in :mod:`casckpt.engine.transfer.exporters`.

        Raises:
            InvalidArgumentError: an unknown format.
            RestoreTargetError: ``to`` cannot be written, or exists (a non-empty directory)
                and ``overwrite`` is false (checked before any data is read).
            UnsupportedStateError: the format cannot hold the state.
            And what :meth:`restore` raises.
        """
        from casckpt.engine.transfer.exporters import check_export, export

        check_export(Path(to), format, overwrite=overwrite)
        version = self.resolve(ref)
        tree = self.restore(version, map_location="cpu", progress=progress)
        return export(tree, version, Path(to), format, overwrite=overwrite)

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

    def restore(self, ref: Ref, into: object = None, *, map_location: Any = None,
                progress: ProgressCallback | None = None, group: Any = None,
                rank: int | None = None) -> Any:
        """Bring back the state of ``ref``, every byte verified.

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
        from casckpt.engine.read import restore as restore_engine  # torch: see commit
        from casckpt.engine.read.ranks import rank_manifest

        manifest = rank_manifest(self._core.manifest(ref), group, rank)
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
        from casckpt.engine.read import restore as restore_engine  # torch: see commit
        from casckpt.engine.read import treeviews
        from casckpt.engine.read.ranks import tensor_manifest
        from casckpt.engine.versions.refs import bind, load_manifest
        from casckpt.format.manifest import decode_manifest

        row = self._core.readable_row(ref)
        head = bind(row, decode_manifest(self._core.catalog.manifest(row.id), row.id))
        one = treeviews.Trees(self._core.catalog).entry(head, path)  # a tree's: only the nodes
        if one is not None:  # on the way to the tensor are read (validated)
            return restore_engine.load_tensor(self._core.ctx, one, one.tensors[0].path, map_location)
        manifest, path = tensor_manifest(load_manifest(self._core.catalog, row), path)
        return restore_engine.load_tensor(self._core.ctx, manifest, path, map_location)

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
        from casckpt.dcp import StoreWriter
        from casckpt.engine.write import commit as commit_engine

        writer = StoreWriter(self._core.ctx, commit_engine.make_request(run, step, metadata, metrics,
                                                                        message, tags))
        self._core.dcp_writers.add(writer)
        return writer

    def dcp_reader(self, ref: Any) -> StoreReader:
        """A ``torch.distributed.checkpoint`` StorageReader for the version ``ref`` names.

        ``dcp.load`` with it reshards onto any number of ranks, each reading only
        the chunks its pieces need. Works for versions saved by ``dcp.save`` and
        by :meth:`commit` (not those saved rank by rank with ``group=``).

        Raises:
            RefNotFoundError, AmbiguousRefError: bad ref.
            RestoreTargetError: the version was saved rank by rank.
        """
        from casckpt.dcp import StoreReader

        row = self._core.readable_row(ref)
        return StoreReader(self._core.ctx, row.id, self._core.manifest(row.id))

    # -- runs, tags, deletes and gc -----------------------------------------

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

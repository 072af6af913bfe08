"""Writing versions into a :class:`casckpt.Store`: states, directories and checkpoint files.

:class:`StoreWrite` is a base class of ``Store``: ``commit`` (blocking, in the background, or
by a group of ranks) and the background commits it leaves pending, directory snapshots
(``add_dir``), imported checkpoints (``import_checkpoint``) and the DCP writer. Each makes
versions through the commit engine (:mod:`casckpt.engine.write`); what reads them back is
:class:`~casckpt.store_read.StoreRead`. Each method is declared once. Thread-safe as the store is.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from casckpt.engine.write.commithandle import CommitHandle
from casckpt.errors import CommitTimeoutError, InvalidArgumentError
from casckpt.store_history import StoreHistory
from casckpt.types import ProgressCallback, Version

if TYPE_CHECKING:
    from casckpt.dcp import StoreWriter
    from casckpt.engine.write.commit import CommitRequest
    from casckpt.engine.write.hint import PathSpec


class StoreWrite(StoreHistory):
    """Commits of states, directories and checkpoint files: a base class of :class:`casckpt.Store`."""

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
            from casckpt.engine.tiering.tier import wait_durable  # what store.tier.wait_durable waits with

            wait_durable(self._core.catalog, [version.id], None, self._core.nudge_drain)
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
        root = self._core.root
        if root is not None and Path(os.path.realpath(root)).is_relative_to(os.path.realpath(path)):
            raise InvalidArgumentError(
                f"the store {str(root)!r} is inside {str(path)!r}, which would change while it is "
                "read; add a directory that does not hold the store")
        state, counts = scan(path, progress, self._core.crypto.file_hasher)
        meta = {**(metadata or {}), DIR_KEY: counts}
        if block:
            return self.commit(state, run=run, step=step, metadata=meta, metrics=metrics,
                               message=message, tags=tags, progress=progress)
        return self.commit(state, run=run, step=step, metadata=meta, metrics=metrics,
                           message=message, tags=tags, progress=progress, block=False)

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


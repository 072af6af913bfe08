"""Reading versions of a :class:`casckpt.Store` back: states, tensors, directories and exports.

:class:`StoreRead` is a base class of ``Store``: ``restore`` (a new tree, or into live
objects), ``load_tensor`` (one tensor, only its chunks), ``checkout`` (a directory snapshot
written back), ``export`` (another checkpoint format) and the DCP reader, every byte verified
by the read engine (:mod:`casckpt.engine.read`). Each method is declared once. Thread-safe as
the store is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from casckpt.errors import CheckoutMismatchError
from casckpt.store_core import Ref
from casckpt.store_history import StoreHistory
from casckpt.types import ProgressCallback

if TYPE_CHECKING:
    import numpy as np
    import torch

    from casckpt.dcp import StoreReader
    from casckpt.engine.transfer.exporters import DirExport


class StoreRead(StoreHistory):
    """Restores, tensor loads, checkouts and exports: a base class of :class:`casckpt.Store`."""

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


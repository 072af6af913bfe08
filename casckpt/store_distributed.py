"""The many-ranks side of the Store facade: DCP writers and readers, versions saved rank by rank.

Mixed into :class:`casckpt.store.Store`. ``torch.distributed.checkpoint`` is
imported only when a DCP writer or reader is asked for.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from casckpt.engine import commit as commit_engine
from casckpt.engine.context import EngineContext
from casckpt.errors import InvalidArgumentError, RestoreTargetError
from casckpt.format.manifest import Manifest, rank_count, rank_view

if TYPE_CHECKING:
    from casckpt.dcp import StoreReader, StoreWriter
    from casckpt.types import Version

_RANK_PATH = re.compile(r"rank(\d+)/(.+)", re.DOTALL)


class StoreDistributed:
    """Saving and loading across the ranks of a ``torch.distributed`` job."""

    _ctx: EngineContext
    _dcp_writers: weakref.WeakSet[StoreWriter]

    if TYPE_CHECKING:  # provided by Store
        def _manifest(self, ref: Any) -> Manifest: ...

        def _row(self, ref: Any) -> Any: ...

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
        from casckpt.dcp import StoreWriter

        request = commit_engine.make_request(run, step, metadata, metrics, message, tags)
        writer = StoreWriter(self._ctx, request)
        self._dcp_writers.add(writer)
        return writer

    def _refuse_close_while_saving(self) -> None:
        """A DCP save (``dcp.async_save``) still writing through this store must finish first."""
        if any(writer.busy for writer in list(self._dcp_writers)):
            raise InvalidArgumentError(
                "a dcp.save / dcp.async_save is writing through this store: wait for it (the "
                "future async_save returned) before closing the store"
            )

    def _release_dcp_writers(self) -> None:
        """End the GC leases of DCP saves that failed (DCP tells the writer nothing on failure)."""
        for writer in list(self._dcp_writers):
            writer.release()

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

        row = self._row(ref)
        return StoreReader(self._ctx, row.id, self._manifest(row.id))

    def _rank_manifest(self, manifest: Manifest, group: Any, rank: int | None) -> Manifest:
        """The manifest to restore on this rank: one rank's tree of a version saved rank by rank."""
        count = rank_count(manifest)
        if count is None:
            return manifest  # one tree for all: every rank restores all of it
        name = f"{manifest.run}@{manifest.step}"
        if group is not None:
            import torch.distributed as dist

            world = dist.get_world_size(group)
            if world != count:
                raise RestoreTargetError(
                    f"{name} was saved rank by rank by {count} ranks; this group has {world}. "
                    "Pass rank= to pick one rank's state, or save sharded state with dcp.save "
                    "(store.dcp_writer), which reshards on load"
                )
            rank = dist.get_rank(group) if rank is None else rank
        if rank is None:
            raise RestoreTargetError(
                f"{name} was saved rank by rank by {count} ranks: pass group= (each rank gets "
                "its own state) or rank= (that rank's state)"
            )
        if not 0 <= rank < count:
            raise InvalidArgumentError(f"{name} holds ranks 0..{count - 1}; there is no rank {rank}")
        return rank_view(manifest, rank)

    def _tensor_manifest(self, manifest: Manifest, path: str) -> tuple[Manifest, str]:
        """For a version saved rank by rank, ``rankN/path`` names a tensor of rank N's state."""
        found = _RANK_PATH.fullmatch(path)
        count = rank_count(manifest)
        if count is None or found is None:
            return self._rank_manifest(manifest, None, None), path
        return self._rank_manifest(manifest, None, int(found.group(1))), found.group(2)

    def _group_commit(self, state: object, request: commit_engine.CommitRequest, group: Any,
                      progress: Any, preflight: Callable[[], object]) -> Version:
        from casckpt.engine.group import group_commit

        return group_commit(self._ctx, state, request, group, progress, preflight)
